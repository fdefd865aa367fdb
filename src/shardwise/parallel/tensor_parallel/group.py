"""A group of ranks a layer talks to, and how its collectives are run.

One small immutable object, built from the topology (``RankGroup.from_topology``) and passed
explicitly to every tensor-parallel layer: no module globals for groups or ranks. It names
no axis: the GPT's tp layers get the tp axis's group, the hybrid CNN
(``apps.cnn.hybrid``) one group of all its ranks, used for its data-parallel layers and its
column / row layers alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankGroup:
    """This rank's group of ranks for one parallel axis (or, in the hybrid CNN, for both).

    group: ``torch.distributed`` process group (``None`` with ``size == 1``).
    size, rank: group size and this rank's position in the group (its shard index in a
        tensor-parallel layer).
    all_reduce: algorithm name passed to ``shardwise.comm.all_reduce`` ("native" is the
        backend's own; "ring" etc. are ours and count bytes exactly).
    gather: algorithm for ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
        ("native" or "ring").
    sequence_parallel: shard LayerNorm / dropout / residual regions along the sequence
        (Korthikanti et al. 2022, arXiv:2205.05198).
    check: run ``shardwise.comm``'s cross-rank argument agreement on each all-reduce. Off
        by default: shapes inside a parallel model are fixed by construction, and the agreement
        round would double the number of messages on the critical path; it applies to the
        all-gathers and reduce-scatters of sequence parallelism too.
    """

    group: Any = None
    size: int = 1
    rank: int = 0
    all_reduce: str = "native"
    gather: str = "native"
    sequence_parallel: bool = False
    check: bool = False
    axis: str = "tp"  # the name its size goes by in error messages

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"RankGroup: rank {self.rank} outside a {self.axis} group of size "
                             f"{self.size}")

    @classmethod
    def from_topology(cls, topology, axis: str = "tp", **options) -> "RankGroup":
        """The ``axis`` ("dp", "pp" or "tp") group of ``topology`` (after
        ``init_process_groups``); options as fields."""
        size = getattr(topology, axis)
        group = getattr(topology.groups, axis) if topology.groups is not None else None
        if size > 1 and group is None:
            raise ValueError("RankGroup.from_topology: call init_process_groups(topology) first")
        return cls(group=group, size=size, rank=getattr(topology, f"{axis}_rank"), axis=axis,
                   **options)

    def shard(self, n: int, what: str) -> int:
        """``n // size``; raises ValueError naming ``what`` when ``n`` is not divisible."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by {self.axis}={self.size}")
        return n // self.size
