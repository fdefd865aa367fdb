"""Every byte that crosses ranks goes through here, and is counted.

Collectives implemented on ``torch.distributed`` point-to-point operations (``isend`` /
``irecv``), each with its textbook algorithm, exact byte accounting and an alpha-beta cost
model; see ``docs/comm.md``. Semantics follow ``torch.distributed`` (in place, global ranks
for ``src``/``dst``, ``group=None`` is the world, ``async_op=True`` returns a handle with
``wait()``).

Contract used by the rest of shardwise (stable signatures):

- ``all_reduce(tensor, op="sum", group=None, algorithm="native", async_op=False)``:
  op in ``REDUCE_OPS``; algorithm in ``ALLREDUCE_ALGORITHMS``.
- ``broadcast(tensor, src, group=None, async_op=False)``: ``src`` is a global rank.
- ``barrier(group=None)``.

Also: ``reduce``, ``gather``, ``scatter``, ``all_gather``, ``all_gather_into_tensor``,
``reduce_scatter``, ``reduce_scatter_tensor``, ``all_to_all``, ``all_to_all_single`` (uneven
splits: ``alltoall.py``), ``send``, ``recv``, ``exchange`` (p2p, each with ``async_op``); ``configure`` (timeout, argument check), ``accounting`` (per-rank byte
counters), ``cost`` (the model and ``auto``), ``shutdown`` (stop the communication thread),
``replay`` (a recomputed region's collectives: recorded in its forward, replayed without
moving a byte when it is recomputed; ``run_again`` for those that run again).
"""

from __future__ import annotations

from shardwise.base.lazy import lazy_exports

# public name -> the submodule that defines it; the submodules themselves (``comm.cost``)
# load on first use too, so the planner's ``comm.cost`` imports no torch
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(["ALL_TO_ALL_ALGORITHMS", "all_to_all", "all_to_all_single"], "alltoall"),
    **dict.fromkeys(["ALL_GATHER_ALGORITHMS", "ALLREDUCE_ALGORITHMS", "BROADCAST_ALGORITHMS",
                     "REDUCE_ALGORITHMS", "REDUCE_SCATTER_ALGORITHMS", "all_reduce",
                     "broadcast", "gather", "reduce", "scatter"], "api"),
    **dict.fromkeys(["Handle", "drain", "shutdown"], "async_"),
    **dict.fromkeys(["barrier", "exchange", "recv", "send"], "p2p"),
    **dict.fromkeys(["REDUCE_OPS", "CommError", "CommTimeoutError", "Settings", "configure",
                     "settings"], "primitives"),
    **dict.fromkeys(["all_gather", "all_gather_into_tensor", "reduce_scatter",
                     "reduce_scatter_tensor"], "sharded"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "ALLREDUCE_ALGORITHMS", "ALL_GATHER_ALGORITHMS", "REDUCE_SCATTER_ALGORITHMS",
    "BROADCAST_ALGORITHMS", "REDUCE_ALGORITHMS", "REDUCE_OPS",
    "all_reduce", "broadcast", "reduce", "gather", "scatter", "all_gather",
    "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "send", "recv",
    "exchange", "all_to_all", "all_to_all_single", "ALL_TO_ALL_ALGORITHMS",
    "barrier", "configure", "settings", "Settings", "CommError", "CommTimeoutError", "Handle",
    "drain", "shutdown", "accounting", "cost", "replay",
]
