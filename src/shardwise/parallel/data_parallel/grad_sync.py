"""Bucketed gradient averaging over a dp group, for engines with many backwards per step.

``DistributedDataParallel`` knows that one ``loss.backward()`` ends a step. A pipeline stage
does not: it runs one backward per (micro-batch, chunk), and only the last backward of each
chunk makes that chunk's gradients final. ``GradientSync`` holds the same buckets as our DDP
(``build_buckets``: reverse registration order, ``param.grad`` a view into its bucket, so
autograd accumulates in place) and is told which backward is final:

- inside ``with sync.final_backward():`` a parameter's post-accumulate-grad hook counts its
  bucket down, and a complete bucket's all-reduce is launched at once (asynchronously,
  through ``shardwise.comm``, in bucket order on every rank), overlapping the rest of the
  schedule, as PyTorch DDP does on the last micro-batch (Li et al., VLDB 2020, 3.2.3);
- ``finish()`` launches whatever is left (buckets whose parameters got no gradient count as
  zeros), waits for every bucket and divides by the dp size: ``param.grad`` is the mean
  (or, with ``average=False``, the sum).

Every rank of the group must make the same calls in the same order (the replicas of one
pipeline stage run the same instruction list, so they do).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.parallel.data_parallel.buckets import Bucket, MiB, build_buckets


class GradientSync:
    """Average the gradients of ``params`` (registration order) over ``group``.

    Args:
        params: parameters with the same shapes and order on every rank of ``group``.
        group: the dp process group.
        bucket_mb / first_bucket_mb: bucket capacities in MiB, as for our DDP.
        allreduce: algorithm name for ``shardwise.comm.all_reduce``.
        on_grad: called at every armed hook, before the bucket counts down (our DDP uses it
            to queue its end-of-backward callback and to time the hooks).
        armed: every backward is final unless inside ``final_backward(False)`` (DDP);
            default: only those inside ``final_backward()`` (the pipeline).
        average: divide the sums by the group size (default); False leaves the sums (the
            CNN's per-layer plans, whose local losses already carry the 1/B of the global
            mean: ``shardwise.apps.cnn.layout``).
        divisor: what ``average`` divides by instead of the group size: expert gradients
            summed over the ``ep_dp`` ranks already hold the ep ranks' tokens, so their mean
            over the whole dp group divides by dp (Megatron-Core's expert gradient scaling).
    """

    def __init__(self, params: list[torch.nn.Parameter], group, bucket_mb: float = 25.0,
                 first_bucket_mb: float | None = None, allreduce: str = "auto",
                 on_grad: Callable[[], None] | None = None, armed: bool = False,
                 average: bool = True, divisor: int | None = None) -> None:
        self.group, self.allreduce, self.on_grad = group, allreduce, on_grad
        self.average = average
        self.divisor = dist.get_world_size(group) if divisor is None else divisor
        first = None if first_bucket_mb is None else max(1, int(first_bucket_mb * MiB))
        self.buckets: list[Bucket] = build_buckets(params, max(1, int(bucket_mb * MiB)), first)
        self._slot: dict[int, tuple[Bucket, int]] = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._slot[id(p)] = (b, i)
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.armed = armed  # hooks count buckets down (else gradients only accumulate)
        self._next = 0
        self.launched_early = 0  # last step: buckets launched before finish() (overlapped)
        self.zero_grad()

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero every bucket in place; each ``param.grad`` is (again) its bucket's view."""
        for b in self.buckets:
            b.buffer.zero_()
            for i, p in enumerate(b.params):
                p.grad = b.view_of(i)

    @contextmanager
    def final_backward(self, final: bool = True) -> Iterator[None]:
        """Backwards inside the block produce final gradients (``final=False``: they do not,
        as under DDP's ``no_sync``): full buckets are launched."""
        prev, self.armed = self.armed, final
        try:
            yield
        finally:
            self.armed = prev

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if not self.armed:
            return
        if self.on_grad is not None:
            self.on_grad()
        bucket, i = self._slot[id(p)]
        if bucket.add_grad(i, p):
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].ready:
            b = self.buckets[self._next]
            b.launched_at = time.perf_counter()
            # shapes are the same on every replica by construction: skip the agreement round
            b.work = comm.all_reduce(b.buffer, op="sum", group=self.group,
                                     algorithm=self.allreduce, async_op=True, check=False)
            self._next += 1

    @torch.no_grad()
    def finish(self) -> list[float]:
        """Launch the remaining buckets, wait for all, divide by the dp size; every
        ``param.grad`` is its bucket's view again. Returns each bucket's launch time
        (``time.perf_counter`` seconds)."""
        self.launched_early = self._next
        for b in self.buckets[self._next:]:
            for i, p in enumerate(b.params):  # gradients that arrived outside final_backward
                if i not in b.fired and p.grad is not None:
                    b.add_grad(i, p)
            b.close_unfired()
        self._launch_ready()
        launched = []
        for b in self.buckets:
            b.work.wait()
            if self.average:
                b.buffer.div_(self.divisor)
            for i, p in enumerate(b.params):
                view = b.view_of(i)
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
            launched.append(b.launched_at)
            b.reset()
        self._next = 0
        return launched
