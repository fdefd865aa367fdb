"""Deterministic, resumable sampler that gives each data-parallel rank a disjoint shard.

The token stream of length L is cut into ``n = (L - 1) // T`` windows of ``T + 1`` tokens
(inputs and next-token targets). Each epoch draws a permutation of the windows from
``torch.Generator().manual_seed(seed + epoch)``. Global batch ``b`` is windows
``perm[b*G : (b+1)*G]``; dp rank ``r`` takes the contiguous slice
``[r*G/dp : (r+1)*G/dp]`` of it. So for any dp the union of the ranks' batches is the same
global batch a single process would draw, which is what makes DDP parity testable, and the
ranks' shards never overlap. Ragged windows at an epoch's end are dropped.

The position (epoch, batch in epoch) counts global batches, not a rank's: saved in a
checkpoint, it resumes the same stream of global batches under any dp (and any tp or pp,
which read what their dp rank reads).

A loss mask (``mask``: 1 where a token is a target, e.g. an assistant's reply in chat data)
turns the other targets into ``IGNORE_INDEX``; ``global_targets`` counts the targets of the
global batch just drawn, the denominator of its mean loss in every layout.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # a target the loss skips (torch.nn.functional.cross_entropy's default)


class DistributedBatchSampler:
    """Yields this rank's ``(x, y)`` of shape ``(G/dp, T)`` each, int64, for every step.

    Args:
        tokens: the encoded split, 1-D: an int64 tensor, or a ``data.shards.TokenStream``
            (memory-mapped shards, indexed like one; only the windows drawn are read).
        block_size: T, tokens per sequence.
        global_batch_size: G, sequences per step over all dp ranks.
        dp_rank, dp_size: this rank's place on the data-parallel axis.
        seed: base seed; epoch ``e`` uses ``seed + e``.
        mask: None (every token a target) or the split's loss mask, 1-D like ``tokens``
            (nonzero: a target); masked targets come out as ``IGNORE_INDEX``.

    Raises ``ValueError`` when the split holds fewer than G windows.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, global_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, mask=None):
        if global_batch_size % dp_size:
            raise ValueError(f"global batch {global_batch_size} not divisible by dp={dp_size}")
        self.tokens, self.mask = tokens, mask
        self.global_targets: int | None = None  # targets of the last global batch (a mask)
        self.block_size = block_size
        self.global_batch_size = global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed = seed
        self.num_windows = (len(tokens) - 1) // block_size
        self.batches_per_epoch = self.num_windows // global_batch_size
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"the split holds {self.num_windows} windows of {block_size + 1} tokens, fewer "
                f"than one global batch of {global_batch_size}")
        self.epoch = 0
        self.batch_in_epoch = 0
        self._perm: torch.Tensor | None = None

    def _permutation(self) -> torch.Tensor:
        if self._perm is None:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            self._perm = torch.randperm(self.num_windows, generator=g)
        return self._perm

    def global_indices(self) -> torch.Tensor:
        """Window indices of the next global batch (all ranks), shape ``(G,)``."""
        G = self.global_batch_size
        return self._permutation()[self.batch_in_epoch * G:(self.batch_in_epoch + 1) * G]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next ``(x, y)``; advances the position by one global batch."""
        local = self.global_batch_size // self.dp_size
        every = self.global_indices()
        idx = every[self.dp_rank * local:(self.dp_rank + 1) * local]
        x, y = self.windows(idx)
        if self.mask is not None:  # every rank reads the global batch's mask: one count
            T = self.block_size
            keep = self.mask[every[:, None] * T + torch.arange(1, T + 1)]  # (G, T)
            self.global_targets = int((keep != 0).sum())
        self.batch_in_epoch += 1
        if self.batch_in_epoch == self.batches_per_epoch:
            self.epoch, self.batch_in_epoch, self._perm = self.epoch + 1, 0, None
        return x, y

    def windows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows ``idx`` (K,) as inputs and next-token targets, each (K, T) int64 (masked
        targets ``IGNORE_INDEX``)."""
        T = self.block_size
        starts = idx * T
        offsets = torch.arange(T + 1)
        pos = starts[:, None] + offsets[None, :]
        w = self.tokens[pos]  # (B, T+1)
        y = w[:, 1:].contiguous()
        if self.mask is not None:
            y[self.mask[pos[:, 1:]] == 0] = IGNORE_INDEX
        return w[:, :-1].contiguous(), y

    def state_dict(self) -> dict:
        """JSON-safe position (epoch, batch in epoch) plus what must match on resume."""
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "seed": self.seed,
                "global_batch_size": self.global_batch_size, "block_size": self.block_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``'s position. Raises ValueError when the seed, global batch
        size or block size differ from this run's (the token stream would not be the same)."""
        for key in ("seed", "global_batch_size", "block_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]}, this run has "
                                 f"{getattr(self, key)}")
        self.epoch, self.batch_in_epoch, self._perm = state["epoch"], state["batch_in_epoch"], None
