"""Each axis the planner models moves its predictions the right way (no processes, seconds).

Full and selective recomputation, sequence parallelism, ZeRO 1-3 (and ZeRO-3's overlap of
its gathers with compute), micro-batch size, pipeline depth and interleaving; the per-
operation compute model (GEMMs by size, memory-bound kernels by bytes, attention by kernel).
"""

from dataclasses import replace

import pytest

from shardwise.planner.hardware import FIXED_PRESETS, PRESETS, per_op
from shardwise.planner.memory import MEGATRON, activation_bytes
from shardwise.planner.search import memory_of, plan, prune_reason
from shardwise.planner.simulate import Layout, simulate, zero3_exposed
from shardwise.planner.specs import NAMED

A100 = PRESETS["dgx-a100-80gb"]
SPEC = NAMED["gpt3-13b"]


def _both(lay, cluster=A100, kernels="shardwise"):
    return memory_of(SPEC, lay, "bf16", kernels), simulate(SPEC, lay, cluster, "bf16")


def test_full_recomputation_trades_memory_for_time():
    base = Layout(4, 2, 2, 1, 8)
    m0, t0 = _both(base)
    m1, t1 = _both(replace(base, recompute=True))
    assert m1["activations"] < m0["activations"]
    assert m1["params"] == m0["params"]
    assert t1["compute"] == pytest.approx(t0["compute"] * 4 / 3, rel=1e-9)  # + one forward
    assert t1["step"] > t0["step"]


@pytest.mark.parametrize("ops", [False, True])
def test_selective_recomputation_sits_between_none_and_full(ops):
    """Megatron's kernels keep the s x s attention scores: recomputing only the attention
    core (Korthikanti et al. 2022) frees them for a fraction of full recomputation's time."""
    cl = per_op(FIXED_PRESETS["dgx-a100-80gb"], "megatron-2021") if ops else \
        FIXED_PRESETS["dgx-a100-80gb"]
    base = Layout(4, 2, 2, 1, 8)
    none, sel, full = base, replace(base, selective=True), replace(base, recompute=True)
    mem = {k: memory_of(SPEC, lay, "bf16", "megatron-2021")["activations"]
           for k, lay in (("none", none), ("sel", sel), ("full", full))}
    step = {k: simulate(SPEC, lay, cl, "bf16")["step"]
            for k, lay in (("none", none), ("sel", sel), ("full", full))}
    assert mem["full"] < mem["sel"] < mem["none"]
    assert step["none"] < step["sel"] < step["full"]
    assert step["sel"] - step["none"] < 0.3 * (step["full"] - step["none"])
    assert "selective and full" in prune_reason(SPEC, replace(full, selective=True), A100, False)


def test_selective_recomputation_saves_nothing_with_flash_attention():
    lay = Layout(4, 2, 2, 1, 8)
    assert memory_of(SPEC, replace(lay, selective=True), "bf16")["activations"] == \
        memory_of(SPEC, lay, "bf16")["activations"]  # flash keeps no scores to drop
    assert simulate(SPEC, replace(lay, selective=True), A100)["step"] > \
        simulate(SPEC, lay, A100)["step"]


def test_selective_recomputation_is_searched_only_when_asked():
    spec, world, batch = NAMED["megatron-18b"], 32, 64
    cl = per_op(A100, "megatron-2021")
    default, _ = plan(spec, cl, world, batch, micro_batches=[1, 2], top=3)
    asked, _ = plan(spec, cl, world, batch, micro_batches=[1, 2], top=3, selective=(False, True))
    assert not any(c.layout.selective for c in default)
    assert asked[0].time["step"] <= default[0].time["step"]


def test_sequence_parallelism_shrinks_activations_and_replaces_all_reduces():
    base = Layout(4, 4, 1, 1, 16)
    m0, t0 = _both(base)
    m1, t1 = _both(replace(base, sp=True))
    assert m1["activations"] < m0["activations"]
    assert t1["tp"] == pytest.approx(t0["tp"], rel=0.05)  # AG + RS moves what AR moves


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_stages_shard_more_and_communicate_more(zero):
    base = Layout(8, 1, 1, 1, 4)
    lower, higher = replace(base, zero=zero - 1), replace(base, zero=zero)
    assert memory_of(SPEC, higher, "bf16")["total"] < memory_of(SPEC, lower, "bf16")["total"]
    if zero == 3:  # gathers per micro-batch: more traffic than ZeRO-2's one pass, unless
        # they hide behind compute (the engine's prefetch)
        off = replace(A100, zero3_overlap=False)
        assert simulate(SPEC, higher, off)["dp"] > simulate(SPEC, lower, off)["dp"]
        assert simulate(SPEC, higher, A100)["dp"] < simulate(SPEC, higher, off)["dp"]


def test_zero3_overlap_hides_gathers_behind_compute():
    spec = NAMED["gpt3-13b"]
    lay = Layout(32, 2, 1, 2, 4, zero=3)
    layers = list(range(spec.n_layer + 2))
    on = zero3_exposed(spec, lay, A100, "bf16", layers)
    off = replace(A100, zero3_overlap=False)
    t_on, t_off = simulate(spec, lay, A100), simulate(spec, lay, off)
    assert t_on["step"] < t_off["step"] and t_on["dp"] < t_off["dp"]
    # a slower fabric exposes more; with compute far longer than a gather, only the ends show
    slow = replace(A100, inter=replace(A100.inter, fixed=replace(
        A100.inter.fixed, beta_link=A100.inter.fixed.beta_link * 20)))
    assert zero3_exposed(spec, lay, slow, "bf16", layers) > on
    big = replace(lay, micro_batch_size=8, micro_batches=1)
    g = A100.link(lay.world).all_gather
    ends = 2 * g(lay.dp, 1e9)  # generous: the first and last gathers, the last scatter
    assert zero3_exposed(spec, big, A100, "bf16", layers) < ends


def test_pipeline_depth_and_interleaving_shrink_the_bubble():
    spec, cl = NAMED["megatron-39b"], A100
    flat = simulate(spec, Layout(8, 8, 2, 1, 32), cl)
    inter = simulate(spec, Layout(8, 8, 2, 1, 32, "interleaved", 4), cl)
    assert inter["bubble"] < flat["bubble"]
    few = simulate(spec, Layout(8, 8, 2, 1, 4), cl)
    assert few["bubble"] / few["step"] > flat["bubble"] / flat["step"]  # (p-1)/(m+p-1)


def test_per_op_gemm_efficiency_grows_with_size_and_megatron_attention_costs_bytes():
    cl = A100  # the default: per operation
    assert cl.ops.gemm(1e12) / 1e12 < cl.ops.gemm(1e10) / 1e10 < cl.ops.gemm(1e8) / 1e8
    assert cl.ops.memory(1e9) / 1e9 < cl.ops.memory(1e6) / 1e6
    lay = Layout(8, 1, 1, 1, 4)
    flash = simulate(SPEC, lay, cl)["compute"]
    unfused = simulate(SPEC, lay, replace(A100, kernels="megatron-2021"))["compute"]
    assert unfused > flash  # softmax and dropout over the s x s scores in memory
    # wider models spend a smaller share of their time in memory-bound kernels
    small, large = NAMED["megatron-1.7b"], NAMED["megatron-1t"]
    from shardwise.planner.simulate import block_ops

    def share(spec, tp):
        gemms, moves = block_ops(spec, 1, tp, False, "megatron-2021", 2)
        mem = sum(cl.ops.memory(x) for x in moves)
        return mem / (mem + sum(cl.ops.gemm(x) for x in gemms))

    assert share(large, 8) < share(small, 1)


def test_megatron_activation_model_counts_scores():
    s = SPEC
    kw = {"mb": 1, "tp": 2, "pp": 1, "micro_batches": 1, "precision": "bf16"}
    assert activation_bytes(s, am=MEGATRON, **kw) > activation_bytes(s, am=MEGATRON,
                                                                      selective=True, **kw)
