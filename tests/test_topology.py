"""The rank grid: coordinates, groups per axis, and rejection of bad sizes (no processes)."""

import dataclasses

import pytest

from shardwise.base.topology import Topology, TopologyError


def test_single_axis_dp4():
    topo = Topology.build(dp=4, rank=2, world_size=4)
    assert topo.coords == {"dp": 2, "pp": 0, "cp": 0, "tp": 0}
    assert topo.axis_ranks("dp") == [0, 1, 2, 3]
    assert topo.axis_ranks("tp") == [2] and topo.axis_ranks("pp") == [2]
    assert topo.is_first_stage and topo.is_last_stage


def test_grid_2x2x2_coordinates_roundtrip_and_groups():
    topo = Topology.build(dp=2, pp=2, tp=2, world_size=8)
    seen = set()
    for r in range(8):
        c = topo.coords_of(r)
        assert topo.rank_of(**c) == r
        seen.add(tuple(c.values()))
    assert len(seen) == 8
    # tp fastest, then pp, then dp
    assert topo.coords_of(5) == {"dp": 1, "pp": 0, "cp": 0, "tp": 1}
    assert topo.all_axis_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.all_axis_groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.all_axis_groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("dp, pp, tp", [(3, 1, 2), (1, 4, 1), (2, 3, 2)])
def test_groups_partition_the_world(dp, pp, tp):
    topo = Topology.build(dp, pp, tp)
    for axis in ("dp", "pp", "tp"):
        groups = topo.all_axis_groups(axis)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(dp * pp * tp))
        assert all(len(g) == getattr(topo, axis) for g in groups)
    last = Topology.build(dp, pp, tp, rank=topo.rank_of(dp - 1, pp - 1, tp - 1))
    assert last.is_last_stage and last.dp_rank == dp - 1


def test_rejects_sizes_that_do_not_multiply_to_world_size():
    with pytest.raises(TopologyError, match=r"dp=2 x pp=2 x tp=1 = 4 ranks, but the world size is 6"):
        Topology.build(dp=2, pp=2, tp=1, world_size=6)


@pytest.mark.parametrize("kwargs, field", [({"dp": 0}, "parallel.dp"), ({"tp": -1}, "parallel.tp")])
def test_rejects_non_positive_sizes(kwargs, field):
    with pytest.raises(TopologyError, match=field):
        Topology.build(**kwargs)


def test_is_immutable():
    topo = Topology.build(dp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.dp = 3


def test_ep_folds_over_dp():
    """ep x dp/ep = dp: ep groups are blocks of consecutive dp ranks, ep_dp groups stride
    them (DeepSpeed-MoE, Megatron-Core); with tp the groups keep the tp coordinate."""
    topo = Topology.build(dp=4, ep=2, world_size=4)
    assert topo.all_groups("ep") == [[0, 1], [2, 3]]
    assert topo.all_groups("ep_dp") == [[0, 2], [1, 3]]
    t = Topology.build(dp=4, tp=2, ep=2, rank=5, world_size=8)   # dp 2, tp 1
    assert (t.dp_rank, t.ep_rank, t.ep_dp_rank) == (2, 0, 1)
    assert t.ep_ranks() == [5, 7] and t.ep_dp_ranks() == [1, 5]
    for r in range(8):
        c = Topology.build(dp=4, tp=2, ep=2, rank=r)
        assert c.dp_rank == c.ep_dp_rank * 2 + c.ep_rank
        assert set(c.ep_ranks()) | set(c.ep_dp_ranks()) <= set(c.axis_ranks("dp"))
    assert Topology.build(dp=4, ep=4).all_groups("ep_dp") == [[0], [1], [2], [3]]
    with pytest.raises(TopologyError, match=r"parallel.ep=3 does not divide parallel.dp=4"):
        Topology.build(dp=4, ep=3)


def test_cp_sits_between_pp_and_tp():
    """rank = ((dp * pp + pp_rank) * cp + cp_rank) * tp + tp_rank: tp fastest, then cp."""
    topo = Topology.build(dp=2, pp=2, tp=2, cp=2, world_size=16)
    assert topo.coords_of(0b1011) == {"dp": 1, "pp": 0, "cp": 1, "tp": 1}
    for r in range(16):
        assert topo.rank_of(**topo.coords_of(r)) == r
    assert topo.all_axis_groups("tp")[:2] == [[0, 1], [2, 3]]
    assert topo.all_axis_groups("cp")[:2] == [[0, 2], [1, 3]]
    assert topo.all_axis_groups("pp")[0] == [0, 4]
    assert topo.all_axis_groups("dp")[0] == [0, 8]
    # the folded group: the dp x cp replicas of one (pp, tp) place, by dp_rank * cp + cp_rank
    assert topo.all_axis_groups("dp_cp")[:2] == [[0, 2, 8, 10], [1, 3, 9, 11]]
    me = Topology.build(dp=2, pp=2, tp=2, cp=2, rank=10)
    assert (me.dp_rank, me.cp_rank, me.dp_cp, me.dp_cp_rank) == (1, 1, 4, 3)
    assert me.axis_ranks("dp_cp")[me.dp_cp_rank] == 10
    for axis in ("dp", "pp", "cp", "tp", "dp_cp"):
        flat = sorted(r for g in topo.all_axis_groups(axis) for r in g)
        assert flat == list(range(16)), axis


def test_cp_one_keeps_the_old_grid_and_names_cp_in_errors():
    old = Topology.build(dp=2, pp=2, tp=2)
    assert [old.coords_of(r)["cp"] for r in range(8)] == [0] * 8
    assert old.all_axis_groups("dp_cp") == old.all_axis_groups("dp")
    with pytest.raises(TopologyError, match=r"dp=1 x pp=1 x cp=4 x tp=1 = 4 ranks, but the world size is 2"):
        Topology.build(cp=4, world_size=2)
    with pytest.raises(TopologyError, match="parallel.cp"):
        Topology.build(cp=0)


def test_ep_groups_stay_within_one_cp_rank():
    """ep and ep_dp are sub-groups of dp, so with cp > 1 they hold the dp ranks of one cp
    rank; ep_dp_cp (the experts' gradient group) adds every cp rank: all the ranks holding
    the same experts, ordered by ep_dp_rank * cp + cp_rank."""
    topo = Topology.build(dp=4, cp=2, ep=2, world_size=8)
    assert topo.all_groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.all_groups("ep_dp_cp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    for r in range(8):
        t = Topology.build(dp=4, cp=2, ep=2, rank=r)
        cps = {t.coords_of(x)["cp"] for x in t.ep_ranks() + t.ep_dp_ranks()}
        assert cps == {t.cp_rank}
        assert t.dp_rank == t.ep_dp_rank * 2 + t.ep_rank
        group = t.ep_dp_cp_ranks()
        assert len(group) == t.ep_dp_cp == 4 and group[t.ep_dp_cp_rank] == r
        assert {t.coords_of(x)["dp"] % 2 for x in group} == {t.ep_rank}  # the same experts
    # with pp and tp the group keeps this rank's (pp, tp) place
    t = Topology.build(dp=2, pp=2, cp=2, tp=2, ep=2, rank=13)
    assert [t.coords_of(x) for x in t.ep_dp_cp_ranks()] == [
        {"dp": 1, "pp": 1, "cp": c, "tp": 1} for c in (0, 1)]
    assert Topology.build(dp=4, ep=2).all_groups("ep_dp_cp") == \
        Topology.build(dp=4, ep=2).all_groups("ep_dp")


def test_hsdp_replicas_are_contiguous_blocks_of_dp():
    """dp = dp_replicate x dp_shard, the shard coordinate fastest (torchtitan's mesh order):
    a replica's dp_shard x cp group is one block of consecutive ranks (one host), the
    dp_replicate group the ranks at the same place of every replica."""
    topo = Topology.build(dp=4, dp_replicate=2, world_size=4)
    assert (topo.dp_shard, topo.dp_shard_cp) == (2, 2)
    assert topo.all_groups("dp_shard_cp") == [[0, 1], [2, 3]]
    assert topo.all_groups("dp_replicate") == [[0, 2], [1, 3]]
    # with cp and tp: a replica of dp2 x cp2 x tp2 is the block 0..7 of 16 ranks
    topo = Topology.build(dp=4, cp=2, tp=2, dp_replicate=2, world_size=16)
    assert topo.all_groups("dp_shard_cp")[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert topo.all_groups("dp_replicate")[:2] == [[0, 8], [1, 9]]
    for r in range(16):
        t = Topology.build(dp=4, cp=2, tp=2, dp_replicate=2, rank=r)
        assert t.dp_rank == t.dp_replicate_rank * t.dp_shard + t.dp_shard_rank
        assert t.dp_shard_cp_ranks()[t.dp_shard_cp_rank] == r
        assert t.dp_replicate_ranks()[t.dp_replicate_rank] == r
        assert {x // 8 for x in t.dp_shard_cp_ranks()} == {r // 8}  # one replica's block
    for kind in ("dp_shard_cp", "dp_replicate"):
        assert sorted(x for g in topo.all_groups(kind) for x in g) == list(range(16))
    # R = 1: the shard group is the dp x cp group, one replica of itself
    one = Topology.build(dp=2, cp=2)
    assert one.all_groups("dp_shard_cp") == one.all_axis_groups("dp_cp")
    assert one.all_groups("dp_replicate") == [[r] for r in range(4)]


def test_hsdp_sizes_that_do_not_divide_are_named():
    with pytest.raises(TopologyError, match=r"parallel.dp_replicate=3 does not divide "
                                            r"parallel.dp=4"):
        Topology.build(dp=4, dp_replicate=3)
    with pytest.raises(TopologyError, match="parallel.dp_replicate"):
        Topology.build(dp=4, dp_replicate=0)
