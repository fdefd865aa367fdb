"""The ``local`` cluster's cost terms (ranks sharing cores), by their shape: no timing here
(numbers belong to ``benchmarks/planner_local.py``); every cluster is built by hand."""

from __future__ import annotations

import math

import pytest

from shardwise.planner.contention import SyncPenalty, group_sizes, penalty_rows
from shardwise.planner.hardware import PRESETS, Cluster, fabric
from shardwise.planner.layout import Layout
from shardwise.planner.memory import rank_params
from shardwise.planner.simulate import (
    block_costs,
    block_flops,
    chunk_costs,
    optimizer_seconds,
    simulate,
    zero3_seconds,
)
from shardwise.planner.specs import ModelSpec

SPEC = ModelSpec("bench", 4, 128, 4, 65, 64, True)
ROWS = ((2, 1e-3, 2e-3), (2, 1e-2, 4e-3), (4, 1e-3, 1e-3), (4, 1e-2, 1e-3))


def shared(sync: SyncPenalty = SyncPenalty(ROWS), cores: int = 2, **kw) -> Cluster:
    """A cluster like ``local``: ranks sharing ``cores`` cores, set by hand."""
    link = fabric("loopback", 1e9, 1e-5)
    return Cluster("local", "CPU", 50e9, 8 * 2**30, 1 << 20, link, link, efficiency=1.0,
                   mem_bw=15e9, overhead_s=1e-4, sync=sync, precision="fp32", cores=cores,
                   zero3_overlap=False, **kw)


def test_sync_penalty_interpolates_in_log_work_per_group_size():
    """A synchronisation's wait: the measured rows of the nearest group size, log-linear in
    the work before it between the measured works, the nearest end beyond them; none for
    one rank, or without rows (a GPU cluster: every preset's table is empty)."""
    s = SyncPenalty(ROWS)
    assert s(2, 1e-3) == 2e-3 and s(2, 1e-2) == 4e-3
    assert s(2, math.sqrt(1e-3 * 1e-2)) == pytest.approx(3e-3)  # the middle in log w
    assert s(2, 0.0) == 2e-3 and s(2, math.inf) == 4e-3  # clamped to the ends
    assert s(4, 5e-3) == 1e-3 and s(8, 5e-3) == 1e-3  # 8: the nearest measured, 4
    assert s(3, 1e-3) == 1e-3  # equally near 2 and 4: the larger
    assert s(1, 1e-3) == 0.0 and SyncPenalty()(4, 1e-3) == 0.0
    assert all(not c.sync.rows for c in PRESETS.values())
    assert group_sizes(8) == [2, 4, 8] and group_sizes(4) == [2, 4]


def test_penalty_rows_are_the_median_rank_extra_beyond_the_price():
    """Per (group size, work): over ranks, the median of (fastest synchronised run - fastest
    run alone), less the planner's price of the all-reduce, never below 0."""
    res = [{(2, 1e-3): {"alone": [1.0, 0.9], "sync": [1.5, 1.2]}},  # extra 0.3
           {(2, 1e-3): {"alone": [1.0, 1.1], "sync": [1.1, 1.6]}},  # 0.1
           {(2, 1e-3): {"alone": [0.5, 0.6], "sync": [1.5, 1.4]}}]  # 0.9
    assert penalty_rows(res, [2], [1e-3], lambda g: 0.05) == ((2, 1e-3, pytest.approx(0.25)),)
    assert penalty_rows(res, [2], [1e-3], lambda g: 1.0) == ((2, 1e-3, 0.0),)


def test_tp_synchronisations_wait_by_group_size_and_work_between_them():
    """A tp block on ranks sharing cores: each of its n_sync forward synchronisations waits
    ``sync(tp, w)`` after w = its block's forward on a core of its own / n_sync, backward
    after twice that; the embedding's and the loss's back-to-back ones after none. A chunk
    holding the embedding, every block and the head adds them up so."""
    lay = Layout(2, 2, 1, 8, 1)
    cl = shared()
    blk = block_costs(SPEC, lay, cl, "fp32")
    w = (block_flops(SPEC, 8) / 2 / cl.rate(1) + cl.overhead_s) / 2  # a core's, per sync
    assert blk.n_sync == 2
    assert blk.sync_penalty == pytest.approx(cl.sync(2, w))
    assert blk.sync_penalty_backward == pytest.approx(cl.sync(2, 2 * w))
    assert blk.sync_penalty_small == cl.sync(2, 0.0) == 2e-3
    (c,) = chunk_costs(SPEC, lay, cl, "fp32")
    (b,) = chunk_costs(SPEC, lay, shared(SyncPenalty()), "fp32")
    L = SPEC.n_layer
    assert c.wait_forward - b.wait_forward == pytest.approx(
        L * 2 * blk.sync_penalty + (1 + 3) * blk.sync_penalty_small)
    assert c.wait_backward - b.wait_backward == pytest.approx(
        L * 2 * blk.sync_penalty_backward + 1 * blk.sync_penalty_small)
    gpu = block_costs(SPEC, lay, PRESETS["dgx-h100"], "bf16")
    assert gpu.sync_penalty == gpu.sync_penalty_backward == gpu.sync_penalty_small == 0.0


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
    reduce-scattered by calls of its own (a latency each), each call's n - 1 ring steps a
    pairwise synchronisation's wait (``ring_wait``)."""
    lay = Layout(4, 1, 1, 4, 1, zero=3)
    cl = shared(SyncPenalty(((2, 1e-4, 1e-3),)))  # each of a ring's 3 steps: 1 ms
    layers = list(range(SPEC.n_layer + 2))
    link = cl.link(lay.world)
    x = [rank_params(SPEC, [i], 1, 1) * 4 for i in layers]
    u = len(layers)
    z = zero3_seconds(SPEC, lay, cl, "fp32", layers)
    g = sum(link.all_gather(4, b) for b in x)
    assert cl.ring_wait(4) == pytest.approx(3e-3) and cl.ring_wait(1) == 0.0
    assert z.forward == pytest.approx(g + u * 3e-3)
    assert z.backward == pytest.approx(g + sum(link.reduce_scatter(4, b) for b in x)
                                       + 2 * u * 3e-3)
    whole = sum(x)
    assert z.forward > link.all_gather(4, whole) + u * 3e-3  # (n - 1) latencies per unit


def test_context_parallel_ranks_share_the_cores_too():
    """The shared walk counts every copy of a pipeline rank that runs at once, cp's too:
    dp2 x cp2 computes as long as dp4 on the same tokens a rank (2 cores, 4 ranks)."""
    cl = shared(SyncPenalty())
    dp = simulate(SPEC, Layout(4, 1, 1, 4, 1), cl)
    cp = simulate(SPEC, Layout(2, 1, 1, 8, 1, cp=2), cl)
    assert cp["compute"] == pytest.approx(dp["compute"], rel=0.1)


def test_collectives_stretch_as_cpu_work_shared_by_the_ranks():
    """A collective of g ranks, priced by the profile that timed the g alone on min(g, cores)
    cores, takes min(1, cores / g) x world / cores times that while the world's ranks share
    the cores; a tp block's, priced for the shared walk (which stretches by world / cores),
    its core_share of it. 1 on a GPU cluster."""
    cl = shared(SyncPenalty())
    assert [cl.comm_stretch(g, w) for g, w in ((2, 4), (4, 4), (2, 8), (4, 8), (8, 8))] == \
        [2.0, 1.0, 4.0, 2.0, 1.0]
    assert cl.comm_stretch(2, 2) == 1.0 and PRESETS["dgx-h100"].comm_stretch(8, 64) == 1.0
    lay = Layout(1, 4, 1, 16, 1)
    act = 16 * 64 * 128 * 4
    whole = 2 * cl.link(4).all_reduce(4, act, tp=True)
    assert block_costs(SPEC, lay, cl, "fp32").tp == pytest.approx(whole)  # stretch 1 at 4
    assert block_costs(SPEC, lay, cl, "fp32", dedicated=True).tp == pytest.approx(whole / 2)


def test_host_seconds_per_micro_batch_go_with_each_forward():
    """``micro_batch_s`` (measured on local) adds to every micro-batch's forward on a rank,
    split over its chunks, stretched by ranks per core unless priced for the shared walk."""
    lay = Layout(2, 1, 2, 2, 4)
    base = chunk_costs(SPEC, lay, shared(SyncPenalty()), "fp32")
    more = chunk_costs(SPEC, lay, shared(SyncPenalty(), micro_batch_s=1e-3), "fp32")
    assert [m.forward - b.forward for m, b in zip(more, base)] == pytest.approx([2e-3] * 2)
    assert [m.backward - b.backward for m, b in zip(more, base)] == [0.0, 0.0]
    ded = chunk_costs(SPEC, lay, shared(SyncPenalty(), micro_batch_s=1e-3), "fp32",
                      dedicated=True)
    base = chunk_costs(SPEC, lay, shared(SyncPenalty()), "fp32", dedicated=True)
    assert [m.forward - b.forward for m, b in zip(ded, base)] == pytest.approx([1e-3] * 2)


def test_context_parallel_ring_steps_wait_off_the_core():
    """Where ranks share cores each transfer of a block's cp ring waits as a pairwise
    synchronisation (``sync(2, 0)``): cp - 1 forward, 2 cp - 1 backward, per block, none
    hidden behind attention; nothing on a GPU cluster."""
    lay = Layout(1, 1, 1, 8, 1, cp=4)
    (c,) = chunk_costs(SPEC, lay, shared(), "fp32")
    (b,) = chunk_costs(SPEC, lay, shared(SyncPenalty()), "fp32")
    L, w = SPEC.n_layer, shared().sync(2, 0.0)
    assert c.wait_forward - b.wait_forward == pytest.approx(L * 3 * w)
    assert c.wait_backward - b.wait_backward == pytest.approx(L * 7 * w)
    gpu = block_costs(SPEC, lay, PRESETS["dgx-h100"], "bf16")
    assert gpu.cp_wait_forward == gpu.cp_wait_backward == 0.0
