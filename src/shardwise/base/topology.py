"""The rank grid: one immutable object for the dp x pp x tp layout, passed explicitly.

Ranks are laid out with tp fastest, then pp, then dp (Megatron's order: tensor-parallel
peers are neighbours, so on a multi-GPU node they share the fastest links)::

    rank = (dp_rank * pp + pp_rank) * tp + tp_rank

For each axis, a group holds the ranks that differ only in that axis' coordinate; e.g. with
dp=2, pp=1, tp=2 the dp groups are {0, 2} and {1, 3} and the tp groups are {0, 1} and {2, 3}.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

AXES = ("dp", "pp", "tp")


class TopologyError(ValueError):
    """Sizes that cannot form a grid over the given world size."""


@dataclass(frozen=True)
class AxisGroups:
    """Process groups of one rank, one per axis (``torch.distributed`` group handles)."""

    dp: Any
    pp: Any
    tp: Any


@dataclass(frozen=True)
class Topology:
    """Rank grid ``dp x pp x tp`` and this rank's place in it.

    Build with ``Topology.build(dp, pp, tp, rank=r)``; attach process groups with
    ``init_process_groups(topology)`` once ``torch.distributed`` is initialised.

    Raises ``TopologyError`` (naming the sizes) when a size is < 1, when
    ``dp * pp * tp != world_size``, or when ``rank`` is outside ``[0, world_size)``.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    rank: int = 0
    groups: AxisGroups | None = field(default=None, compare=False, repr=False)

    @classmethod
    def build(cls, dp: int = 1, pp: int = 1, tp: int = 1, *, rank: int = 0,
              world_size: int | None = None) -> "Topology":
        for name, size in (("dp", dp), ("pp", pp), ("tp", tp)):
            if not isinstance(size, int) or size < 1:
                raise TopologyError(f"parallel.{name}={size!r}: every axis size must be an integer >= 1")
        product = dp * pp * tp
        if world_size is not None and product != world_size:
            raise TopologyError(
                f"dp={dp} x pp={pp} x tp={tp} = {product} ranks, but the world size is {world_size}")
        if not 0 <= rank < product:
            raise TopologyError(f"rank {rank} is outside the grid of {product} ranks")
        return cls(dp=dp, pp=pp, tp=tp, rank=rank)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def coords_of(self, rank: int) -> dict[str, int]:
        """``{"dp": i, "pp": j, "tp": k}`` for a global rank."""
        return {"dp": rank // (self.pp * self.tp), "pp": (rank // self.tp) % self.pp,
                "tp": rank % self.tp}

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        """Global rank at grid coordinates ``(dp, pp, tp)``; inverse of ``coords_of``."""
        return (dp * self.pp + pp) * self.tp + tp

    @property
    def coords(self) -> dict[str, int]:
        return self.coords_of(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def axis_ranks(self, axis: str, rank: int | None = None) -> list[int]:
        """Global ranks of ``rank``'s group along ``axis`` (ordered by that axis' coordinate)."""
        if axis not in AXES:
            raise TopologyError(f"unknown axis {axis!r}; expected one of {AXES}")
        c = self.coords_of(self.rank if rank is None else rank)
        size = getattr(self, axis)
        return [self.rank_of(**{**c, axis: i}) for i in range(size)]

    def all_axis_groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``, each a list of global ranks, in a fixed order."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(tuple(self.axis_ranks(axis, r)), None)
        return [list(g) for g in seen]


def init_process_groups(topology: Topology) -> Topology:
    """Create one process group per axis group (collectively, on every rank).

    Every rank must call this in the same order; returns a copy of ``topology`` whose
    ``groups`` hold this rank's dp, pp and tp groups.
    """
    import torch.distributed as dist

    if dist.get_world_size() != topology.world_size:
        raise TopologyError(
            f"dp={topology.dp} x pp={topology.pp} x tp={topology.tp} = {topology.world_size} "
            f"ranks, but the world size is {dist.get_world_size()}")
    mine = {}
    for axis in AXES:
        for ranks in topology.all_axis_groups(axis):
            group = dist.new_group(ranks)
            if topology.rank in ranks:
                mine[axis] = group
    return replace(topology, groups=AxisGroups(**mine))
