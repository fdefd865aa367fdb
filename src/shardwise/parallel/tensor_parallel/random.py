"""Dropout randomness for tensor parallelism: identical where activations are replicated,
different where they are split.

Replicated regions (LayerNorm, residual, dropout after a reduced output) use the default
generator, seeded identically on every tp rank, so every rank draws the same mask and the
replicas stay equal. Parallel regions (attention probabilities of this rank's heads, and,
under sequence parallelism, this rank's slice of the sequence) draw from a second state
seeded ``seed + 2718 + tp_rank``, swapped in for the duration of the region: Megatron-LM's
model-parallel RNG tracker (Shoeybi et al. 2019, arXiv:1909.08053, section 3).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

PARALLEL_SEED_OFFSET = 2718


class ParallelRNG:
    """Generator state for parallel regions; ``with rng.fork():`` uses it in place of the
    default generator (CPU, or the current CUDA device's when ``device`` is CUDA)."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.tp_rank = tp_rank
        self._outer: list = []  # default-stream states saved by enter(), innermost last
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Restart the stream from ``seed`` (plus the offset and the tp rank, as at build)."""
        self.seed = seed + PARALLEL_SEED_OFFSET + self.tp_rank
        with torch.random.fork_rng(devices=self._devices()):
            torch.manual_seed(self.seed)
            self.state = self._get()

    def _devices(self) -> list:
        return [self.device] if self.device.type == "cuda" else []

    def _get(self) -> torch.Tensor:
        return (torch.cuda.get_rng_state(self.device) if self.device.type == "cuda"
                else torch.get_rng_state())

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self):
        """Draw from the parallel stream inside; nested forks share the one being drawn."""
        self.enter()
        try:
            yield
        finally:
            self.exit()

    @torch.compiler.disable  # swaps the RNG state: runs eagerly inside a compiled layer
    def enter(self) -> None:
        """Start a parallel region (``fork`` without the ``with``: a module's forward hooks)."""
        if self._outer:  # already inside one: keep drawing from it
            self._outer.append(None)
            return
        self._outer.append(self._get())
        self._set(self.state)

    @torch.compiler.disable
    def exit(self) -> None:
        """End a parallel region: save the parallel stream's state and restore the outer one
        (nothing for a nested region)."""
        saved = self._outer.pop()
        if saved is not None:
            self.state = self._get()
            self._set(saved)

    @contextlib.contextmanager
    def replicated(self):
        """Draw from the replicated (default) stream, even inside a parallel region: a
        dropout on a replicated activation within a module that computes on heads."""
        if not self._outer:
            yield
            return
        outer = self._outer[0]
        mine = self._get()
        self._set(outer)
        try:
            yield
        finally:
            self._outer[0] = self._get()
            self._set(mine)


class TPDropout(nn.Module):
    """Dropout whose mask comes from ``rng`` when ``parallel`` (a split region) and from
    the default generator otherwise (a replicated region). Same shape in and out."""

    def __init__(self, p: float, rng: ParallelRNG, parallel: bool):
        super().__init__()
        self.p, self.rng, self.parallel = p, rng, parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout of ``x`` with probability ``p``, its mask from ``rng``'s parallel stream
        (``parallel``) or the default generator; identity in eval or at ``p = 0``."""
        if not self.training or self.p == 0.0:
            return x
        with self.rng.fork() if self.parallel else self.rng.replicated():
            return F.dropout(x, self.p, True)
