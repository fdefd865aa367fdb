"""Gradient buckets: parameters packed, in reverse registration order, into flat buffers.

Backward produces gradients roughly in reverse order of parameter registration, so
packing parameters in that order fills the first bucket first and lets its all-reduce
start while backward still computes the rest (Li et al., "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB 2020, section 3.2.3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

MiB = 1 << 20  # bucket capacities are configured in MiB


@dataclass
class Bucket:
    """A flat buffer holding the gradients of ``params``; ``offsets[i]`` is param i's start.

    ``buffer`` has shape ``(sum of numels,)`` and the params' dtype and device. Per-backward
    state (``pending``, ``work``, times) is reset by the owner after each step.
    """

    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    pending: int = 0
    ready: bool = False
    work: Any = None
    launched_at: float | None = None
    fired: set[int] = field(default_factory=set)

    @property
    def numel(self) -> int:
        """Elements of the bucket's parameters (the buffer may be padded beyond this)."""
        return self.offsets[-1] + self.params[-1].numel()

    @property
    def nbytes(self) -> int:
        """Bytes of the bucket's flat gradient buffer."""
        return self.buffer.numel() * self.buffer.element_size()

    def view_of(self, i: int) -> torch.Tensor:
        """The slice of ``buffer`` that holds param ``i``'s gradient, shaped like the param."""
        p = self.params[i]
        return self.buffer[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)

    def add_grad(self, i: int, p: torch.nn.Parameter) -> bool:
        """Put param ``i``'s gradient into its slot (``p.grad`` becomes the slot's view);
        returns True when this was the last missing gradient of the bucket.

        Raises ``RuntimeError`` if param ``i`` already delivered a gradient this backward.
        """
        if i in self.fired:
            raise RuntimeError(f"parameter {i} of bucket {self.index} produced two gradients "
                               "in one backward; call backward once per step (or use no_sync)")
        view = self.view_of(i)
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view
        self.fired.add(i)
        self.pending -= 1
        self.ready = self.pending == 0
        return self.ready

    def close_unfired(self) -> None:
        """End of backward: slots of parameters that got no gradient (unused) become zeros."""
        for i in range(len(self.params)):
            if i not in self.fired:
                self.view_of(i).zero_()
        self.ready = True

    def reset(self) -> None:
        """Before a backward: every parameter pending again, no reduction in flight."""
        self.pending, self.ready, self.work, self.launched_at = len(self.params), False, None, None
        self.fired = set()


def build_buckets(params: list[torch.nn.Parameter], cap_bytes: int,
                  first_cap_bytes: int | None = None, pad_to: int = 1,
                  isolate: frozenset[int] = frozenset()) -> list[Bucket]:
    """Pack ``params`` (given in registration order) into buckets of at most ``cap_bytes``.

    Parameters are taken in reverse order; a bucket closes when the next parameter would
    push it past its cap or has another dtype or device. The first bucket (the gradients
    backward produces first) may have a smaller cap, ``first_cap_bytes`` (never larger than
    ``cap_bytes``), so that its
    all-reduce starts early; PyTorch's DDP does the same with 1 MiB. A parameter larger
    than the cap gets a bucket of its own, and so does every parameter whose ``id`` is in
    ``isolate`` (a tied weight whose shard must cover the same elements on two pipeline
    stages whatever else each stage holds). Each buffer is zero-padded to a multiple of
    ``pad_to`` elements (ZeRO pads to the world size). Raises ``ValueError`` if a cap is
    < 1 byte.
    """
    first_cap_bytes = cap_bytes if first_cap_bytes is None else min(first_cap_bytes, cap_bytes)
    if cap_bytes < 1 or first_cap_bytes < 1:
        raise ValueError(f"bucket capacities must be >= 1 byte, got {cap_bytes}, {first_cap_bytes}")
    groups: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        cur = groups[-1] if groups else None
        cap = first_cap_bytes if len(groups) == 1 else cap_bytes
        if (cur is None or size + nbytes > cap or cur[0].dtype != p.dtype
                or cur[0].device != p.device or id(p) in isolate or id(cur[-1]) in isolate):
            groups.append([p])
            size = nbytes
        else:
            cur.append(p)
            size += nbytes
    buckets = []
    for i, group in enumerate(groups):
        offsets, total = [], 0
        for p in group:
            offsets.append(total)
            total += p.numel()
        padded = -(-total // pad_to) * pad_to
        buf = torch.zeros(padded, dtype=group[0].dtype, device=group[0].device)
        b = Bucket(index=i, params=group, offsets=offsets, buffer=buf)
        b.reset()
        buckets.append(b)
    return buckets
