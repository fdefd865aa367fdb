"""The ``local`` cluster's cost terms (ranks sharing cores), by their shape: no timing here
(numbers belong to ``benchmarks/planner_local.py``); every cluster is built by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardwise.comm import cost
from shardwise.planner.hardware import PRESETS, Cluster, Link, fabric
from shardwise.planner.layout import Layout
from shardwise.planner.memory import rank_params
from shardwise.planner.simulate import (
    block_costs,
    chunk_costs,
    optimizer_seconds,
    simulate,
    zero3_seconds,
)
from shardwise.planner.specs import ModelSpec

SPEC = ModelSpec("bench", 4, 128, 4, 65, 64, True)


def shared(cores: int = 2, link: Link = fabric("loopback", 1e9, 1e-5), **kw) -> Cluster:
    """A cluster like ``local``: ranks sharing ``cores`` cores, set by hand."""
    return Cluster("local", "CPU", 50e9, 8 * 2**30, 1 << 20, link, link, efficiency=1.0,
                   mem_bw=15e9, overhead_s=1e-4, precision="fp32", cores=cores,
                   zero3_overlap=False, **kw)


def test_measured_optimizer_is_per_parameter_and_shares_the_cores():
    """``optimizer_param_s`` (measured on local) prices the step per parameter of the rank,
    slowed by ranks per core; without it, 40 bytes a parameter at the memory bandwidth."""
    layers = list(range(SPEC.n_layer + 2))
    P = rank_params(SPEC, layers, 1, 1)
    lay = Layout(8, 1, 1, 2, 1)
    got = optimizer_seconds(SPEC, lay, shared(optimizer_param_s=5e-9), layers)
    assert got == pytest.approx(5e-9 * P * 8 / 2)
    assert optimizer_seconds(SPEC, lay, shared(), layers) == pytest.approx(40 * P / 15e9 * 4)


def test_zero3_on_shared_cores_pays_each_units_calls():
    """ZeRO-3 where ranks share cores: every unit (embedding, blocks, head) gathered and
    reduce-scattered by calls of its own (n - 1 latencies each), stretched as CPU work
    (``comm_stretch``: 1 for 4 ranks on 2 cores, as the profile timed them)."""
    lay = Layout(4, 1, 1, 4, 1, zero=3)
    cl = shared()
    layers = list(range(SPEC.n_layer + 2))
    link = cl.link(lay.world)
    x = [rank_params(SPEC, [i], 1, 1) * 4 for i in layers]
    whole = sum(x)
    z = zero3_seconds(SPEC, lay, cl, "fp32", layers)
    g = sum(link.all_gather(4, b) for b in x)
    assert cl.comm_stretch(4, 4) == 1.0
    assert z.forward == pytest.approx(g)
    assert z.backward == pytest.approx(g + sum(link.reduce_scatter(4, b) for b in x))
    assert z.forward > link.all_gather(4, whole)  # n - 1 latencies per unit, not per chunk


def test_context_parallel_ranks_share_the_cores_too():
    """The shared walk counts every copy of a pipeline rank that runs at once, cp's too:
    dp2 x cp2 computes as long as dp4 on the same tokens a rank (2 cores, 4 ranks)."""
    cl = shared()
    dp = simulate(SPEC, Layout(4, 1, 1, 4, 1), cl)
    cp = simulate(SPEC, Layout(2, 1, 1, 8, 1, cp=2), cl)
    assert cp["compute"] == pytest.approx(dp["compute"], rel=0.1)


def test_collectives_stretch_as_cpu_work_shared_by_the_ranks():
    """A collective of g ranks, priced by the profile that timed the g alone on min(g, cores)
    cores, takes min(1, cores / g) x world / cores times that while the world's ranks share
    the cores; a tp block's, priced for the shared walk (which stretches by world / cores),
    its core_share of it. 1 on a GPU cluster."""
    cl = shared()
    assert [cl.comm_stretch(g, w) for g, w in ((2, 4), (4, 4), (2, 8), (4, 8), (8, 8))] == \
        [2.0, 1.0, 4.0, 2.0, 1.0]
    assert cl.comm_stretch(2, 2) == 1.0 and PRESETS["dgx-h100"].comm_stretch(8, 64) == 1.0
    lay = Layout(1, 4, 1, 16, 1)
    act = 16 * 64 * 128 * 4
    whole = 2 * cl.link(4).all_reduce(4, act, tp=True)
    assert block_costs(SPEC, lay, cl, "fp32").tp == pytest.approx(whole)  # stretch 1 at 4
    assert block_costs(SPEC, lay, cl, "fp32", dedicated=True).tp == pytest.approx(whole / 2)


def test_a_tied_embeddings_all_reduce_stretches_like_every_collective():
    """The tied embedding's gradient all-reduce between the first and last stages is CPU
    work shared with the other ranks too (``comm_stretch``: 2 for 2 of 4 ranks on 2
    cores); a GPU preset's is its link's price."""
    from shardwise.planner.comm_price import tied_seconds

    lay, cl = Layout(2, 1, 2, 4, 2), shared()
    one = cl.link(4).all_reduce(2, 65 * 128 * 4)
    assert tied_seconds(SPEC, lay, cl, "fp32", 0) == pytest.approx(2 * one)
    assert tied_seconds(SPEC, lay, cl, "fp32", 1) == pytest.approx(2 * one)
    h100 = PRESETS["dgx-h100"]
    assert tied_seconds(SPEC, lay, h100, "fp32", 0) == h100.link(4).all_reduce(
        2, 65 * 128 * 4)


def test_host_seconds_per_micro_batch_go_with_each_forward():
    """``micro_batch_s`` (measured on local) adds to every micro-batch's forward on a rank,
    split over its chunks, stretched by ranks per core unless priced for the shared walk."""
    lay = Layout(2, 1, 2, 2, 4)
    base = chunk_costs(SPEC, lay, shared(), "fp32")
    more = chunk_costs(SPEC, lay, shared(micro_batch_s=1e-3), "fp32")
    assert [m.forward - b.forward for m, b in zip(more, base)] == pytest.approx([2e-3] * 2)
    assert [m.backward - b.backward for m, b in zip(more, base)] == [0.0, 0.0]
    ded = chunk_costs(SPEC, lay, shared(micro_batch_s=1e-3), "fp32",
                      dedicated=True)
    base = chunk_costs(SPEC, lay, shared(), "fp32", dedicated=True)
    assert [m.forward - b.forward for m, b in zip(ded, base)] == pytest.approx([1e-3] * 2)



def test_contention_slows_every_rank_s_cpu_work_but_not_the_comm_profile():
    """``contention`` (measured at the world size: ``shared_seconds``) slows a rank's
    compute in the shared walk, its optimizer step and its host seconds by that factor;
    the gradient all-reduce keeps the profile's price (its own stretch)."""
    lay = Layout(4, 1, 1, 4, 1)
    base, slow = shared(optimizer_param_s=5e-9), shared(optimizer_param_s=5e-9, contention=1.5)
    a, b = simulate(SPEC, lay, base), simulate(SPEC, lay, slow)
    assert b["compute"] == pytest.approx(1.5 * a["compute"])
    assert b["optimizer"] == pytest.approx(1.5 * a["optimizer"])
    assert b["dp"] == pytest.approx(a["dp"]) and a["dp"] > 0
    assert slow.sharing(4) == 3.0 and slow.sharing(1) == 1.0  # a dedicated core's price
    assert PRESETS["dgx-h100"].sharing(64) == 1.0


def test_each_ring_message_costs_its_measured_seconds_unhidden():
    """``ring_message_s`` (measured: ``shared_seconds``, the transfer and the host's work)
    prices a block's cp ring in place of the profile's overlapped transfers: forward cp - 1
    messages and backward cp - 1 + cp (``ring_messages``), none of it hidden behind
    attention; a recomputed forward sends its cp - 1 again; nothing without a ring."""
    lay = Layout(1, 1, 1, 4, 1, cp=4)
    a = block_costs(SPEC, lay, shared(), "fp32", dedicated=True)
    b = block_costs(SPEC, lay, shared(ring_message_s=1e-3), "fp32", dedicated=True)
    assert (b.cp_forward, b.cp_backward, b.ring_again) == pytest.approx((3e-3, 7e-3, 3e-3))
    assert a.cp_forward < 3e-3 and a.ring_again > 0  # the profile's: a transfer overlapped
    flat = Layout(4, 1, 1, 4, 1)
    assert block_costs(SPEC, flat, shared(ring_message_s=1e-3), "fp32") == \
        block_costs(SPEC, flat, shared(), "fp32")


def test_a_pipeline_send_or_receive_costs_half_a_ring_message():
    """At pp > 1 each chunk's forward receives its input (unless it embeds) and sends its
    output (unless it has the head), its backward the gradients the other way: half a
    ``ring_message_s`` each (a ring step sends and receives). pp2: one each end; pp4's
    middle chunks two."""
    r = 1e-3
    for pp, msgs in ((2, [1, 1]), (4, [1, 2, 2, 1])):
        lay = Layout(1, 1, pp, 2, 8)
        a = chunk_costs(SPEC, lay, shared(), "fp32")
        b = chunk_costs(SPEC, lay, shared(ring_message_s=r), "fp32")
        assert [y.forward - x.forward for x, y in zip(a, b)] == pytest.approx(
            [n * r / 2 for n in msgs])
        assert [y.backward - x.backward for x, y in zip(a, b)] == pytest.approx(
            [n * r / 2 for n in msgs])


def test_shared_seconds_reads_contention_and_ring_messages_off_the_probe(monkeypatch):
    """``shared_seconds``' arithmetic on the probe's steps (spawn replaced by numbers; a
    spawn per layout: dp, alone, cp, dp, alone, dp; a layout's step: its steps' slowest
    rank, a fifth of the way up them sorted, its spawns together): contention = (dp step - its
    all-reduce's price) / (alone x world / cores); ring_message_s = (cp step - dp step) /
    (world / cores) / contention / ((3 cp - 2) x blocks), cp 4 at world size 4, the
    probe's model as deep as the planned one up to PROBE_LAYERS; no alone spawn and
    contention 1 where the ranks fit the cores."""
    from shardwise import launch
    from shardwise.planner import hardware as hw

    spec = ModelSpec("bench", 6, 128, 4, 65, 64, True)
    dp = [0.05, 0.01] + [0.04 + i * 1e-4 for i in range(3 * hw.SHARED_STEPS - 2)]
    fifth = sorted(dp)[len(dp) // hw.PROBE_QUANTILE]  # not the outlier 0.01
    assert fifth > 0.04
    spawned = []

    def spawn(fn, ws, args, **kw):  # (the probe's model, cp)
        spawned.append((ws, args[1], args[0].n_layer))
        return [(runs[(ws, args[1])].pop(0), 1000)] * ws

    monkeypatch.setattr(launch, "spawn", spawn)
    n = hw.SHARED_STEPS
    runs = {(4, 1): [dp[:n], dp[n:2 * n], dp[2 * n:]], (4, 4): [[0.1] * n],
            (1, 1): [[0.011] * n, [0.01] * (n - 1) + [0.05]]}
    alone = sorted([0.011] * n + [0.01] * (n - 1) + [0.05])[2 * n // hw.PROBE_QUANTILE]
    cl = shared()
    sync = cl.comm_stretch(4, 4) * cl.intra.all_reduce(4, 4 * 1000)
    c, ring = hw.shared_seconds(spec, 64, cl, 4)
    L = hw.PROBE_LAYERS
    assert spawned == [(4, 1, L), (1, 1, L), (4, 4, L), (4, 1, L), (1, 1, L), (4, 1, L)]
    assert L < spec.n_layer and alone == 0.01
    assert c == pytest.approx((fifth - sync) / (alone * 2))
    assert ring == pytest.approx((0.1 - fifth) / 2 / c / (10 * L))
    assert hw._probe_cp(4, 64) == 4 and hw._probe_cp(6, 64) == 2 and hw._probe_cp(3, 64) == 1
    assert hw.probe_spec(replace(spec, n_layer=2), 64).n_layer == 2
    spawned.clear()
    runs[(3, 1)] = [dp[:n], dp[n:2 * n], dp[2 * n:]]
    assert hw.shared_seconds(spec, 64, shared(cores=8), 3) == (1.0, 0.0)  # ranks fit
    assert spawned == [(3, 1, L)] * 3  # no ring at 3, no rank alone


def test_eight_ranks_are_stretched_from_the_profiles_four():
    """A profile measured at 2 and 4 ranks prices 8 with 4's constants, timed on half a core
    each: 8 ranks sharing 2 cores stretch it 2x, where a profile with 8 would not."""
    prm = fabric("x", 1e9, 1e-5).fixed
    two_four = Link("lo", profile=cost.Profile("t", {2: prm, 4: prm}), algorithm="auto")
    with_eight = Link("lo", profile=cost.Profile("t", {2: prm, 4: prm, 8: prm}),
                      algorithm="auto")
    assert shared(link=two_four).comm_stretch(8, 8) == 2.0
    assert shared(link=with_eight).comm_stretch(8, 8) == 1.0
    assert shared(link=two_four).comm_stretch(4, 8) == 2.0
    assert cost.Profile("t", {2: prm, 4: prm}).measured_size(8) == 4


def test_local_cluster_measures_the_ranks_sharing_at_the_world_size():
    """``local_cluster`` at a world size above the cores spawns that many ranks of a
    one-layer model (``shared_seconds``): they run slower than the cores' share of one
    alone (contention above its floor of 1) and the cp ring's messages cost host time; at
    world size 1 neither is measured."""
    import os

    from shardwise.planner.hardware import local_cluster

    cores = os.cpu_count() or 1
    if 2 * cores > 8:
        pytest.skip("the probe's world (twice the cores) would exceed 8 ranks")
    spec = ModelSpec("probe", 2, 32, 4, 65, 32, True)
    cl = local_cluster(32, 32, 4, 2 * cores, spec=spec)
    assert cl.contention > 1.0 and cl.ring_message_s > 0.0
    assert cl.meta["contention"] == cl.contention
    one = local_cluster(32, 32, 4, 1, spec=spec)
    assert one.contention == 1.0 and one.ring_message_s == 0.0


def test_a_described_model_is_calibrated_as_its_sizes_only_where_they_rebuild_it():
    """``family_sized``: a TOML's plain ``[model]`` (configs/tiny.toml) is its sizes, so
    ``--cluster local`` times its family's one-layer model; a described model its sizes do
    not hold (Gemma 2's sandwich norms and soft caps) is not."""
    from pathlib import Path

    from shardwise.planner.hardware import family_sized
    from shardwise.planner.specs import load_model

    tiny = load_model(str(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"))
    assert tiny.description is not None
    sized = family_sized(tiny)
    assert sized is not None and sized.description is None and sized == tiny
    gemma = load_model("gemma2-2b")
    assert gemma.description is not None and family_sized(gemma) is None


def test_zero12_ring_steps_wait_a_measured_message_where_ranks_share_cores():
    """ZeRO-1/2's reduce-scatter and all-gather are the engine's ring, 2 (n - 1) steps: on
    a local cluster with a measured ring message each step costs at least that message
    with the world on the cores (``ring_message_s`` x ``sharing``) in place of the
    profile's latency; without one (or on a GPU preset) the profile's price alone. ZeRO-0's
    all-reduce is not a ring of ours here, and keeps its price."""
    from shardwise.planner.comm_price import dp_seconds

    layers = list(range(SPEC.n_layer + 2))
    lay = Layout(4, 1, 1, 4, 1, zero=1)
    plain = dp_seconds(SPEC, lay, shared(), "fp32", layers).after
    cl = shared(ring_message_s=4e-4, contention=1.5)
    x = rank_params(SPEC, layers, 1, 1) * 4
    link = cl.link(lay.world)
    st = cl.comm_stretch(4, 4)
    want = (st * (link.reduce_scatter(4, x) + link.all_gather(4, x) - 6 * 1e-5)
            + 6 * 4e-4 * cl.sharing(4))
    assert dp_seconds(SPEC, lay, cl, "fp32", layers).after == pytest.approx(want)
    assert want > plain + 6 * 4e-4 * 2 * 1.5 * 0.9  # the messages, not the profile's 10 us
    z2 = Layout(4, 1, 1, 4, 1, zero=2)
    assert dp_seconds(SPEC, z2, cl, "fp32", layers).after == pytest.approx(want)
    z0 = Layout(4, 1, 1, 4, 1)
    assert (dp_seconds(SPEC, z0, cl, "fp32", layers).after
            == dp_seconds(SPEC, z0, shared(), "fp32", layers).after)
    h100 = PRESETS["dgx-h100"]
    assert dp_seconds(SPEC, lay, h100, "bf16", layers).after == pytest.approx(
        h100.intra.reduce_scatter(4, x / 2) + h100.intra.all_gather(4, x / 2))
