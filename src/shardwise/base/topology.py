"""The rank grid: one immutable object for the dp x pp x cp x tp layout, passed explicitly.

Ranks are laid out with tp fastest, then cp, then pp, then dp (Megatron's order puts
tensor-parallel peers next to each other and context-parallel peers next: they talk every
layer, so on a multi-GPU node they share the fastest links)::

    rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank

With ``cp = 1`` this is the dp x pp x tp grid of before, rank for rank.

For each axis, a group holds the ranks that differ only in that axis' coordinate; e.g. with
dp=2, pp=1, tp=2 the dp groups are {0, 2} and {1, 3} and the tp groups are {0, 1} and {2, 3}.

One folded group more, ``dp_cp``: the ranks that differ only in their dp or cp coordinate
(dp x cp of them, ordered by ``dp_rank * cp + cp_rank``). They hold the same parameters
(context parallelism splits the sequence, not the weights), so the gradient sync and ZeRO's
shards span it, as Megatron-LM's data-parallel group "with context parallel" does.

Expert parallelism folds over dp, as in DeepSpeed-MoE and Megatron-Core: ``ep`` divides
``dp`` and each dp group is cut into blocks of ``ep`` consecutive dp coordinates, the ep
groups (the ranks that split the experts among them and swap tokens by all-to-all); the
dp ranks at the same place of every block form the ``ep_dp`` group (dp / ep ranks holding
the same experts, over which the experts' gradients are reduced)::

    dp_rank = ep_dp_rank * ep + ep_rank

With dp=4, ep=2 (pp = cp = tp = 1) the ep groups are {0, 1} and {2, 3}, the ep_dp groups
{0, 2} and {1, 3}. They are named sub-groups of the dp axis, not an axis of the world: both
are drawn from one dp group, so from the dp ranks of one (pp, cp, tp) place.

With cp > 1 the cp ranks of a dp rank hold the same experts too (cp splits tokens, not
weights), so the experts' gradients are reduced over the folded ``ep_dp_cp`` group: the
ep_dp ranks of every cp coordinate ((dp / ep) x cp ranks, ordered by
``ep_dp_rank * cp + cp_rank``), as ``dp_cp`` folds cp into dp for the dense weights
(Megatron-Core's expert data-parallel group, which takes cp in the same way). With dp=4,
cp=2, ep=2 (ranks ``dp_rank * 2 + cp_rank``): ep groups {0, 2}, {1, 3}, {4, 6}, {5, 7};
ep_dp_cp groups {0, 1, 4, 5} and {2, 3, 6, 7}.

HSDP (hybrid sharded data parallelism) splits dp into ``dp_replicate`` replicas (R) of
``dp_shard = dp / R`` ranks (S), the shard coordinate fastest, as torchtitan's
``dp_replicate`` x ``dp_shard`` mesh dimensions::

    dp_rank = dp_replicate_rank * dp_shard + dp_shard_rank

so a replica is a contiguous block of ranks (one host, or a group of hosts). ZeRO shards over
the ``dp_shard_cp`` group (the dp_shard x cp ranks of one replica, ordered by
``dp_shard_rank * cp + cp_rank``; with R = 1 the ``dp_cp`` group) and the gradients are then
averaged over the ``dp_replicate`` group (the R ranks at the same place of every replica).
With dp=4, R=2 (pp = cp = tp = 1): dp_shard_cp groups {0, 1} and {2, 3}, dp_replicate
groups {0, 2} and {1, 3}.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

AXES = ("dp", "pp", "cp", "tp")  # slowest to fastest
FOLDED = {"dp_cp": ("dp", "cp")}  # groups spanning several axes (gradient sync over dp x cp)


class TopologyError(ValueError):
    """Sizes that cannot form a grid over the given world size."""


@dataclass(frozen=True)
class AxisGroups:
    """Process groups of one rank, one per axis and one per folded group (``FOLDED``):
    ``torch.distributed`` group handles."""

    dp: Any
    pp: Any
    tp: Any
    cp: Any = None
    dp_cp: Any = None
    ep: Any = None     # with ep > 1: this rank's expert-parallel group (a block of dp)
    ep_dp: Any = None  # with ep > 1: the dp ranks holding this rank's experts
    ep_dp_cp: Any = None  # ep_dp x cp: every rank holding this rank's experts (their grads)
    dp_shard_cp: Any = None  # HSDP: this replica's dp_shard x cp ranks (ZeRO's shards)
    dp_replicate: Any = None  # HSDP, R > 1: the ranks at this place of every replica


@dataclass(frozen=True)
class Topology:
    """Rank grid ``dp x pp x cp x tp`` and this rank's place in it.

    Build with ``Topology.build(dp, pp, tp, cp=c, rank=r)``; attach process groups with
    ``init_process_groups(topology)`` once ``torch.distributed`` is initialised.

    ``ep`` (expert parallelism, folded over dp: see the module docstring) must divide dp, and
    so must ``dp_replicate`` (HSDP's replicas, R; ``dp_shard = dp / R``).

    Raises ``TopologyError`` (naming the sizes) when a size is < 1, when
    ``dp * pp * cp * tp != world_size``, when ep or dp_replicate does not divide dp, or when
    ``rank`` is outside ``[0, world_size)``.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    rank: int = 0
    groups: AxisGroups | None = field(default=None, compare=False, repr=False)
    cp: int = 1
    ep: int = 1
    dp_replicate: int = 1

    @classmethod
    def build(cls, dp: int = 1, pp: int = 1, tp: int = 1, *, cp: int = 1, rank: int = 0,
              world_size: int | None = None, ep: int = 1,
              dp_replicate: int = 1) -> "Topology":
        """The grid with every size checked (``world_size``, when given, must be dp x pp x cp x tp),
        no process groups yet. Raises ``TopologyError`` naming the offending size."""
        for name, size in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp), ("ep", ep),
                           ("dp_replicate", dp_replicate)):
            if not isinstance(size, int) or size < 1:
                raise TopologyError(f"parallel.{name}={size!r}: every axis size must be an integer >= 1")
        if dp % ep:
            raise TopologyError(f"parallel.ep={ep} does not divide parallel.dp={dp}: expert "
                                "parallelism folds over the data-parallel ranks (ep x dp/ep = dp)")
        if dp % dp_replicate:
            raise TopologyError(f"parallel.dp_replicate={dp_replicate} does not divide "
                                f"parallel.dp={dp}: HSDP splits the data-parallel ranks into "
                                "dp_replicate x dp_shard = dp")
        product = dp * pp * cp * tp
        if world_size is not None and product != world_size:
            sizes = f"dp={dp} x pp={pp}" + (f" x cp={cp}" if cp > 1 else "") + f" x tp={tp}"
            raise TopologyError(f"{sizes} = {product} ranks, but the world size is {world_size}")
        if not 0 <= rank < product:
            raise TopologyError(f"rank {rank} is outside the grid of {product} ranks")
        return cls(dp=dp, pp=pp, tp=tp, rank=rank, cp=cp, ep=ep, dp_replicate=dp_replicate)

    @property
    def world_size(self) -> int:
        """Ranks in the grid: ``dp * pp * cp * tp``."""
        return self.dp * self.pp * self.cp * self.tp

    def coords_of(self, rank: int) -> dict[str, int]:
        """``{"dp": i, "pp": j, "cp": c, "tp": k}`` for a global rank."""
        return {"dp": rank // (self.pp * self.cp * self.tp),
                "pp": (rank // (self.cp * self.tp)) % self.pp,
                "cp": (rank // self.tp) % self.cp, "tp": rank % self.tp}

    def rank_of(self, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        """Global rank at grid coordinates ``(dp, pp, cp, tp)``; inverse of ``coords_of``."""
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    @property
    def coords(self) -> dict[str, int]:
        """This rank's ``{"dp", "pp", "cp", "tp"}`` coordinates (``coords_of(rank)``)."""
        return self.coords_of(self.rank)

    @property
    def dp_rank(self) -> int:
        """This rank's dp coordinate: its index in its dp group."""
        return self.coords["dp"]

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage index: 0 the first, ``pp - 1`` the last."""
        return self.coords["pp"]

    @property
    def tp_rank(self) -> int:
        """This rank's tp coordinate: which slice of each tensor-parallel weight it holds."""
        return self.coords["tp"]

    @property
    def cp_rank(self) -> int:
        """This rank's cp coordinate: which share of each sequence's tokens it processes."""
        return self.coords["cp"]

    @property
    def dp_cp(self) -> int:
        """Size of the folded dp x cp group: the replicas of every parameter."""
        return self.dp * self.cp

    @property
    def dp_cp_rank(self) -> int:
        """This rank's index in its ``dp_cp`` group, ``dp_rank * cp + cp_rank``."""
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def dp_shard(self) -> int:
        """HSDP: data-parallel ranks in one replica, ``dp / dp_replicate`` (S)."""
        return self.dp // self.dp_replicate

    @property
    def dp_replicate_rank(self) -> int:
        """HSDP: which replica this rank belongs to, ``dp_rank // dp_shard``."""
        return self.dp_rank // self.dp_shard

    @property
    def dp_shard_rank(self) -> int:
        """HSDP: place in the replica, ``dp_rank % dp_shard``."""
        return self.dp_rank % self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """Size of the folded dp_shard x cp group: the ranks ZeRO shards over (one replica)."""
        return self.dp_shard * self.cp

    @property
    def dp_shard_cp_rank(self) -> int:
        """This rank's index in its ``dp_shard_cp`` group, ``dp_shard_rank * cp + cp_rank``."""
        return self.dp_shard_rank * self.cp + self.cp_rank

    def dp_shard_cp_ranks(self, rank: int | None = None) -> list[int]:
        """Global ranks of ``rank``'s dp_shard_cp group, by ``dp_shard_rank * cp + cp_rank``."""
        c = self.coords_of(self.rank if rank is None else rank)
        first = c["dp"] // self.dp_shard * self.dp_shard
        return [self.rank_of(first + d, c["pp"], c["tp"], cp=k)
                for d in range(self.dp_shard) for k in range(self.cp)]

    def dp_replicate_ranks(self, rank: int | None = None) -> list[int]:
        """Global ranks of ``rank``'s dp_replicate group, by replica: its place in each."""
        c = self.coords_of(self.rank if rank is None else rank)
        return [self.rank_of(r * self.dp_shard + c["dp"] % self.dp_shard, c["pp"], c["tp"],
                             cp=c["cp"]) for r in range(self.dp_replicate)]

    @property
    def ep_rank(self) -> int:
        """Place in the ep group: which slice of the experts this rank holds."""
        return self.dp_rank % self.ep

    @property
    def ep_dp_rank(self) -> int:
        """Place in the ep_dp group (the dp ranks holding the same experts)."""
        return self.dp_rank // self.ep

    @property
    def ep_dp_cp(self) -> int:
        """Size of the folded ep_dp x cp group: the replicas of this rank's experts."""
        return self.dp // self.ep * self.cp

    @property
    def ep_dp_cp_rank(self) -> int:
        """This rank's index in its ``ep_dp_cp`` group, ``ep_dp_rank * cp + cp_rank``."""
        return self.ep_dp_rank * self.cp + self.cp_rank

    def ep_ranks(self, rank: int | None = None) -> list[int]:
        """Global ranks of ``rank``'s ep group, by ep rank: its block of ep dp ranks."""
        dp = self.axis_ranks("dp", rank)
        start = self.coords_of(self.rank if rank is None else rank)["dp"] // self.ep * self.ep
        return dp[start:start + self.ep]

    def ep_dp_ranks(self, rank: int | None = None) -> list[int]:
        """Global ranks of ``rank``'s ep_dp group, by ep_dp rank: every ep-th dp rank."""
        dp = self.axis_ranks("dp", rank)
        return dp[self.coords_of(self.rank if rank is None else rank)["dp"] % self.ep::self.ep]

    def ep_dp_cp_ranks(self, rank: int | None = None) -> list[int]:
        """Global ranks of ``rank``'s ep_dp_cp group, by ``ep_dp_rank * cp + cp_rank``: its
        ep_dp ranks at every cp coordinate (every rank holding the same experts)."""
        c = self.coords_of(self.rank if rank is None else rank)
        return [self.rank_of(d, c["pp"], c["tp"], cp=k)
                for d in range(c["dp"] % self.ep, self.dp, self.ep) for k in range(self.cp)]

    def all_groups(self, kind: str = "ep") -> list[list[int]]:
        """Every ``kind`` ("ep", "ep_dp", "ep_dp_cp", or HSDP's "dp_shard_cp" and
        "dp_replicate") group, each a list of global ranks, fixed order."""
        of = {"ep": self.ep_ranks, "ep_dp": self.ep_dp_ranks,
              "ep_dp_cp": self.ep_dp_cp_ranks, "dp_shard_cp": self.dp_shard_cp_ranks,
              "dp_replicate": self.dp_replicate_ranks}[kind]
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(tuple(of(r)), None)
        return [list(g) for g in seen]

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds the first stage (``pp_rank == 0``; True if pp=1)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last stage (``pp_rank == pp - 1``; True if pp=1)."""
        return self.pp_rank == self.pp - 1

    def axis_ranks(self, axis: str, rank: int | None = None) -> list[int]:
        """Global ranks of ``rank``'s group along ``axis`` (ordered by that axis' coordinate),
        or along a folded group of ``FOLDED`` (ordered by the folded index: ``dp_cp``'s is
        ``dp_rank * cp + cp_rank``)."""
        c = self.coords_of(self.rank if rank is None else rank)
        if axis in FOLDED:
            out = [c]
            for a in FOLDED[axis]:
                out = [{**x, a: i} for x in out for i in range(getattr(self, a))]
            return [self.rank_of(**x) for x in out]
        if axis not in AXES:
            raise TopologyError(f"unknown axis {axis!r}; expected one of {AXES + tuple(FOLDED)}")
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
    ``groups`` hold this rank's dp, pp, cp and tp groups and its ``dp_cp`` group (with
    ``cp = 1`` the dp group itself: no group is made twice), and with ep > 1 its ep and
    ep_dp groups (with ep = 1 the ep_dp group is the dp group) and its ``ep_dp_cp`` group
    (made only with ep > 1 and cp > 1: else the ep_dp group with cp = 1, the dp_cp group
    with ep = 1), and with dp_replicate > 1 its ``dp_shard_cp`` and ``dp_replicate`` groups
    (with R = 1: the dp_cp group, and no replicate group).
    """
    import torch.distributed as dist

    if dist.get_world_size() != topology.world_size:
        cp = f" x cp={topology.cp}" if topology.cp > 1 else ""
        raise TopologyError(
            f"dp={topology.dp} x pp={topology.pp}{cp} x tp={topology.tp} = "
            f"{topology.world_size} ranks, but the world size is {dist.get_world_size()}")
    mine = {}
    for axis in AXES + (("dp_cp",) if topology.cp > 1 else ()):
        for ranks in topology.all_axis_groups(axis):
            group = dist.new_group(ranks)
            if topology.rank in ranks:
                mine[axis] = group
    mine.setdefault("dp_cp", mine["dp"])
    mine["ep_dp"] = mine["dp"]
    kinds = ("ep", "ep_dp") + (("ep_dp_cp",) if topology.cp > 1 else ())
    if topology.ep > 1:
        for kind in kinds:
            for ranks in topology.all_groups(kind):
                group = dist.new_group(ranks)
                if topology.rank in ranks:
                    mine[kind] = group
    mine.setdefault("ep_dp_cp", mine["ep_dp"] if topology.cp == 1 else mine["dp_cp"])
    if topology.dp_replicate > 1:
        for kind in ("dp_shard_cp", "dp_replicate"):
            for ranks in topology.all_groups(kind):
                group = dist.new_group(ranks)
                if topology.rank in ranks:
                    mine[kind] = group
    mine.setdefault("dp_shard_cp", mine["dp_cp"])
    return replace(topology, groups=AxisGroups(**mine))
