"""Tokens per second over a logging interval, as FLOP/s per rank and MFU."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shardwise.perf.gpus import Peak


@dataclass
class Throughput:
    """Measures a run between logging points (``mark``), never inside a step.

    ``flops_per_token``: ``perf.flops_per_token`` of the model; ``world_size``: the ranks that
    share each step's work (the FLOPs of a step are split evenly among them: FLOP/s per rank
    is the model's FLOP/s over ``world_size``); ``peak``: one rank's device peak.
    """

    flops_per_token: float
    world_size: int
    peak: Peak
    _t0: float | None = field(default_factory=time.perf_counter)
    _elapsed: float = 0.0
    _tokens: int = 0
    _steps: int = 0

    def add(self, tokens: int) -> None:
        """One step of ``tokens`` (the global batch's tokens) was issued."""
        self._tokens += tokens
        self._steps += 1

    def mark(self) -> dict:
        """Rates since the last ``mark`` (call after the device finished the interval's work,
        e.g. after a host synchronisation). Returns ``tokens_per_s`` (the whole job),
        ``step_s``, ``flops_per_s`` (per rank) and ``mfu`` (fraction of peak, None when the
        peak is unknown), then starts a new interval."""
        now = time.perf_counter()
        dt = max(self._elapsed + (now - self._t0 if self._t0 is not None else 0.0), 1e-9)
        tps = self._tokens / dt
        fps = self.flops_per_token * tps / self.world_size
        out = {"tokens_per_s": tps, "step_s": dt / max(self._steps, 1), "flops_per_s": fps,
               "mfu": fps / self.peak.flops if self.peak.flops else None}
        self._t0, self._elapsed, self._tokens, self._steps = now, 0.0, 0, 0
        return out

    def pause(self) -> None:
        """Stop the clock (after a synchronisation): evaluation and checkpoints are not
        training time."""
        if self._t0 is not None:
            self._elapsed += time.perf_counter() - self._t0
            self._t0 = None

    def resume(self) -> None:
        """Start the clock again after ``pause`` (nothing when it runs)."""
        if self._t0 is None:
            self._t0 = time.perf_counter()
