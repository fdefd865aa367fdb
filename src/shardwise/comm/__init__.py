"""Every byte that crosses ranks goes through here.

Public contract used by the rest of shardwise (signatures are stable; the algorithms
behind them are filled in by ``shardwise.comm`` itself):

- ``all_reduce(tensor, op="sum", group=None, algorithm="native", async_op=False)``
  in place, like ``torch.distributed.all_reduce``; returns a handle with ``wait()``
  when ``async_op`` is true, else ``None``.
- ``broadcast(tensor, src, group=None, async_op=False)``: ``src`` is a global rank.
- ``barrier(group=None)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, algorithm: str = "native",
               async_op: bool = False):
    """Reduce ``tensor`` across ``group`` in place. ``op`` is sum, mean, max or min."""
    if op == "mean":
        work = dist.all_reduce(tensor, dist.ReduceOp.SUM, group=group, async_op=async_op)
        n = dist.get_world_size(group)
        if async_op:
            return _Then(work, lambda: tensor.div_(n))
        tensor.div_(n)
        return None
    return dist.all_reduce(tensor, _OPS[op], group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group``, in place."""
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def barrier(group=None) -> None:
    dist.barrier(group=group)


class _Then:
    def __init__(self, work, fn):
        self._work, self._fn = work, fn

    def wait(self):
        self._work.wait()
        self._fn()
        return True
