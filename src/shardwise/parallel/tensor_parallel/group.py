"""The tensor-parallel group a layer talks to, and how its collectives are run.

One small immutable object, built from the topology (``TPGroup.from_topology``) and passed
explicitly to every tensor-parallel layer: no module globals for groups or ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TPGroup:
    """This rank's tensor-parallel group.

    group: ``torch.distributed`` process group of the tp axis (``None`` with ``size == 1``).
    size, rank: tp size and this rank's position in the group (shard index).
    all_reduce: algorithm name passed to ``shardwise.comm.all_reduce`` ("native" is the
        backend's own; "ring" etc. are ours and count bytes exactly).
    gather: algorithm for ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
        ("native" or "ring").
    sequence_parallel: shard LayerNorm / dropout / residual regions along the sequence
        (Korthikanti et al. 2022, arXiv:2205.05198).
    check: run ``shardwise.comm``'s cross-rank argument agreement on each all-reduce. Off
        by default: shapes inside a TP model are fixed by construction, and the agreement
        round would double the number of messages on the critical path. (All-gather and
        reduce-scatter have no per-call switch; they follow ``comm.configure(check=...)``.)
    """

    group: Any = None
    size: int = 1
    rank: int = 0
    all_reduce: str = "native"
    gather: str = "native"
    sequence_parallel: bool = False
    check: bool = False

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPGroup: rank {self.rank} outside a tp group of size {self.size}")

    @classmethod
    def from_topology(cls, topology, **options) -> "TPGroup":
        """The tp group of ``topology`` (after ``init_process_groups``); options as fields."""
        group = topology.groups.tp if topology.groups is not None else None
        if topology.tp > 1 and group is None:
            raise ValueError("TPGroup.from_topology: call init_process_groups(topology) first")
        return cls(group=group, size=topology.tp, rank=topology.tp_rank, **options)

    def shard(self, n: int, what: str) -> int:
        """``n // size``; raises ValueError naming ``what`` when ``n`` is not divisible."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by tp={self.size}")
        return n // self.size
