"""Each axis the planner models moves its predictions the right way (no processes, seconds).

Full and selective recomputation, sequence parallelism, ZeRO 1-3 (and ZeRO-3's overlap of
its gathers with compute), micro-batch size, pipeline depth and interleaving; context
parallelism (activations 1 / cp, ring traffic, gradients over dp x cp), expert parallelism
(expert memory 1 / ep, all-to-all bytes, expert gradients over dp / ep), FP8 (faster GEMMs
only where the GPU has FP8); the per-operation compute model (GEMMs by size, memory-bound
kernels by bytes, attention by kernel); which axes the search offers for which model.
"""

from dataclasses import replace

import pytest

from shardwise.planner.hardware import FIXED_PRESETS, PRESETS, per_op
from shardwise.planner.memory import MEGATRON, activation_bytes
from shardwise.planner.search import memory_of, plan, prune_reason
from shardwise.planner.simulate import Layout, simulate, zero3_seconds
from shardwise.planner.specs import NAMED

A100 = PRESETS["dgx-a100-80gb"]
H100 = PRESETS["dgx-h100"]
SPEC = NAMED["gpt3-13b"]


def _both(lay, cluster=A100, kernels="shardwise"):
    return memory_of(SPEC, lay, "bf16", kernels), simulate(SPEC, lay, cluster, "bf16")


def test_full_recomputation_trades_memory_for_time():
    base = Layout(4, 2, 2, 1, 8)
    # the attention kernel's backward at twice its forward (not the measured 3.18), so
    # that a backward is two forwards and recomputation adds a third
    two = replace(A100, ops=replace(A100.ops, attn_backward=2.0))
    m0, t0 = _both(base, two)
    m1, t1 = _both(replace(base, recompute=True), two)
    assert m1["activations"] < m0["activations"]
    assert m1["params"] == m0["params"]
    assert t1["compute"] == pytest.approx(t0["compute"] * 4 / 3, rel=1e-9)  # + one forward
    assert t1["step"] > t0["step"]


@pytest.mark.parametrize("ops", [False, True])
def test_attention_core_recomputation_sits_between_none_and_full(ops):
    """Megatron's kernels keep the s x s attention scores: recomputing only the attention
    core (Korthikanti et al. 2022; ``Layout.selective``, priced for their published runs,
    not searched) frees them for a fraction of full recomputation's time."""
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


def test_attention_core_recomputation_saves_nothing_with_flash_attention():
    lay = Layout(4, 2, 2, 1, 8)
    assert memory_of(SPEC, replace(lay, selective=True), "bf16")["activations"] == \
        memory_of(SPEC, lay, "bf16")["activations"]  # flash keeps no scores to drop
    assert simulate(SPEC, replace(lay, selective=True), A100)["step"] > \
        simulate(SPEC, lay, A100)["step"]


@pytest.mark.slow  # two exhaustive searches of megatron-18b (11 s): make test's time
def test_selective_recomputation_is_searched_only_when_asked():
    """``selective=(False, True)`` adds the engine's selective recomputation
    (``recompute="selective"``), never the attention-core mode."""
    spec, world, batch = NAMED["megatron-18b"], 32, 64
    default, _ = plan(spec, A100, world, batch, micro_batches=[1, 2], top=3, exhaustive=True)
    asked, _ = plan(spec, A100, world, batch, micro_batches=[1, 2], top=3, exhaustive=True,
                    selective=(False, True))
    assert not any(c.layout.recompute == "selective" for c in default)
    assert any(c.layout.recompute == "selective" for c in asked)
    assert not any(c.layout.selective for c in default + asked)
    assert asked[0].time["step"] <= default[0].time["step"]


# --- the engine's selective recomputation (parallel.recompute = "selective") ------------

LLAMA = NAMED["llama3-8b"]


def test_engine_selective_keeps_what_activation_bytes_counts_between_none_and_full():
    """A Llama block: its bytes are ``activation_bytes(recompute="selective")``'s, fewer than
    without recomputation and more than full recomputation's where several micro-batches
    are in flight (pp 4, 1F1B; at pp 1 full recomputation keeps the whole stage and
    selective is the one that saves)."""
    from shardwise.planner.memory import selective_block_bytes

    for lay in (Layout(1, 2, 4, 1, 16, sp=True), Layout(1, 2, 4, 1, 16), Layout(4, 1, 4, 2, 8),
                Layout(2, 1, 2, 1, 8, cp=2)):
        act = {rc: memory_of(LLAMA, replace(lay, recompute=rc), "bf16")["activations"]
               for rc in (False, "selective", True)}
        want = activation_bytes(LLAMA, mb=lay.micro_batch_size, tp=lay.tp, pp=lay.pp,
                                micro_batches=lay.micro_batches, sp=lay.sp, cp=lay.cp,
                                recompute="selective", precision="bf16")
        assert act["selective"] == want, lay
        assert act[False] > act["selective"], lay
        if lay.cp == 1 and lay.pp == 4 and lay.micro_batch_size == 1:
            assert act[True] < act["selective"], lay
    one = Layout(4, 1, 1, 1, 4)  # pp 1: full recomputation keeps the stage, selective less
    assert memory_of(LLAMA, replace(one, recompute="selective"), "bf16")["activations"] < \
        memory_of(LLAMA, replace(one, recompute=True), "bf16")["activations"]
    # the Llama block: input + Q, K, V (GQA: 8 of 32 heads) + attention out + gate, up +
    # two row-parallel outputs (units of s h e; plus the fp32 log-sum-exp)
    h, f, s = LLAMA.n_embd, LLAMA.ffn, LLAMA.block_size
    units = 1 + (1 + 2 * 8 / 32 + 1) + 2 * f / h + 2 + 4 * LLAMA.n_head / (h * 2)
    assert selective_block_bytes(LLAMA, 1, s, 1, False, "bf16") == pytest.approx(
        s * h * 2 * units, rel=1e-12)


@pytest.mark.parametrize("lay", [Layout(4, 2, 1, 1, 4, sp=True), Layout(2, 2, 2, 1, 8),
                                 Layout(2, 1, 1, 1, 4, cp=2), Layout(2, 2, 1, 1, 4, cp=2)],
                         ids=lambda lay: lay.label())
def test_engine_selective_time_is_plain_plus_recomputed_ops_and_one_ring_pass(lay):
    """Backward gains the block's memory-bound ops but attention's (``recomputed_ops``, by
    bytes on the per-op model), no GEMM, no tp / SP collective (replayed), and under cp one
    forward ring pass per block, exposed: per rank m x blocks x each."""
    from shardwise.planner.simulate import op_seconds, recomputed_ops, ring_seconds

    t0 = simulate(LLAMA, lay, H100, "bf16")
    t1 = simulate(LLAMA, replace(lay, recompute="selective"), H100, "bf16")
    blocks = LLAMA.n_layer // lay.pp * lay.micro_batches
    redo = op_seconds(H100, recomputed_ops(LLAMA, 1, lay.tp, lay.sp, "shardwise", 2, lay.cp))
    assert redo > 0
    assert t1["compute"] - t0["compute"] == pytest.approx(blocks * redo, rel=1e-6)
    assert t1["tp"] == pytest.approx(t0["tp"], rel=1e-12)
    ring = ring_seconds(LLAMA, lay, H100, 2).forward
    assert (ring > 0) == (lay.cp > 1)
    assert t1["cp"] - t0["cp"] == pytest.approx(blocks * ring, rel=1e-6, abs=1e-12)
    full = simulate(LLAMA, replace(lay, recompute=True), H100, "bf16")
    assert t0["step"] < t1["step"] < full["step"]


def test_engine_selective_wins_where_plain_does_not_fit():
    """llama2-7b on 16 H100s, batch 64: with selective recomputation asked, the best layout
    is one whose plain twin does not fit the 78 GiB a plan may fill and whose
    full-recomputation twin does not either or is slower (at pp 1 full recomputation keeps
    the stage); it beats the best without selective. Eager blocks (``compiled=False``):
    compiled ones keep a quarter less, and then the plain layout fits."""
    spec, limit = NAMED["llama2-7b"], H100.memory_per_rank(16)
    eager = replace(H100, compiled=False)
    default, _ = plan(spec, eager, 16, 64, micro_batches=[1, 2, 4], top=3)
    asked, _ = plan(spec, eager, 16, 64, micro_batches=[1, 2, 4], top=3,
                    selective=(False, True))
    best = asked[0]
    assert best.layout.recompute == "selective"
    assert best.time["step"] < default[0].time["step"]
    assert memory_of(spec, replace(best.layout, recompute=False), "bf16")["total"] > limit
    full = replace(best.layout, recompute=True)
    assert memory_of(spec, full, "bf16")["total"] > limit or \
        simulate(spec, full, H100, "bf16")["step"] > best.time["step"]


def test_a_gpu_plan_leaves_the_reserve_free():
    """The GPU presets' plans fill at most their memory less ``GPU_RESERVED`` (the CUDA
    context, NCCL's buffers, fragmentation): llama3-8b on 16 H100s, batch 64, with selective
    recomputation, is best at 78.6 GiB when the whole 80 may be filled, a layout no default
    plan offers; ``memory_limit`` (``--memory-gib``) sets the limit instead."""
    from shardwise.planner.hardware import GPU_RESERVED

    assert H100.memory_per_rank(16) == H100.memory - GPU_RESERVED == 78 * 2 ** 30
    kw = dict(micro_batches=[1, 2], top=2, selective=(False, True), cp=[1, 2])
    whole, _ = plan(LLAMA, H100, 16, 64, memory_limit=H100.memory, **kw)
    assert H100.memory_per_rank(16) < whole[0].memory["total"] <= H100.memory
    default, _ = plan(LLAMA, H100, 16, 64, **kw)
    assert all(c.memory["total"] <= H100.memory_per_rank(16) for c in default)
    assert default[0].time["step"] > whole[0].time["step"]


def test_engine_selective_is_pruned_for_a_mixture_of_experts():
    from shardwise.planner.search import SELECTIVE_MOE

    moe = NAMED["mixtral-8x7b"].with_seq(1024)
    feasible, pruned = plan(moe, H100, 16, 32, micro_batches=[1], top=2, cp=[1],
                            selective=(False, True))
    assert not any(c.layout.recompute == "selective" for c in feasible)
    rec = [p for p in pruned if p.reason == SELECTIVE_MOE]
    assert len(rec) == 1 and rec[0].count > 0
    assert prune_reason(moe, Layout(16, 1, 1, 1, 2, recompute="selective"), H100, False) == \
        SELECTIVE_MOE


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
    on = sum(zero3_seconds(spec, lay, A100, "bf16", layers))
    off = replace(A100, zero3_overlap=False)
    t_on, t_off = simulate(spec, lay, A100), simulate(spec, lay, off)
    assert t_on["step"] < t_off["step"] and t_on["dp"] < t_off["dp"]
    # a slower fabric exposes more; with compute far longer than a gather, only the ends show
    slow = replace(A100, inter=replace(A100.inter, fixed=replace(
        A100.inter.fixed, beta_link=A100.inter.fixed.beta_link * 20)))
    assert sum(zero3_seconds(spec, lay, slow, "bf16", layers)) > on
    big = replace(lay, micro_batch_size=8, micro_batches=1)
    g = A100.link(lay.world).all_gather
    ends = 2 * g(lay.dp, 1e9)  # generous: the first and last gathers, the last scatter
    prefetch = replace(A100, zero3_exposed=0.0)  # prefetch alone, nothing else exposed
    assert sum(zero3_seconds(spec, big, prefetch, "bf16", layers)) < ends
    # the presets, inside one node (NVLink): at least ZERO3_EXPOSED of every gather and
    # reduce-scatter stays exposed (llm-foundry's FSDP runs: benchmarks/planner_measured.py),
    # however long the compute; across nodes (big: 64 GPUs) prefetch hides them as before
    from shardwise.planner.hardware import ZERO3_EXPOSED
    from shardwise.planner.memory import rank_params

    assert sum(zero3_seconds(spec, big, A100, "bf16", layers)) == sum(
        zero3_seconds(spec, big, prefetch, "bf16", layers))
    node = Layout(8, 1, 1, 8, 1, zero=3)
    link = A100.link(node.world)
    x = rank_params(spec, layers, 1, 1) * 2
    floor = ZERO3_EXPOSED * (2 * link.all_gather(8, x) + link.reduce_scatter(8, x))
    got = sum(zero3_seconds(spec, node, A100, "bf16", layers))
    assert A100.zero3_exposed == ZERO3_EXPOSED  # per unit: its latency steps too
    assert floor <= got <= floor * 1.1
    assert got > sum(zero3_seconds(spec, node, prefetch, "bf16", layers))


@pytest.mark.parametrize("overlap,recompute", [(True, False), (True, True), (False, False)])
def test_zero3_pipeline_seconds_are_the_documented_formula(overlap, recompute):
    """``zero3_seconds`` by hand for each stage of a dp 8 x tp 2 x pp 4 ZeRO-3 layout
    (gathers g_i and reduce-scatters r_i of each layer's elements over dp, c_i its forward,
    b_i = 2 c_i or 3 c_i): forward g_0 + sum_{i>=1} max(0, g_i - c_{i-1}); backward g_k +
    sum_j max(0, g_{j-1} + r_{j+1} - b_j) + r_0; without overlap g(x) + u pen and g(x) +
    r(x) + 2 u pen for the stage's x elements. Each chunk's forward and backward are
    ZeRO-1's plus these (``ChunkCost.dp`` their sum), and the step's dp part is m of them."""
    from shardwise.planner.memory import rank_params, stage_layers
    from shardwise.planner.simulate import chunk_costs, unit_forward_seconds

    cl = A100 if overlap else replace(A100, zero3_overlap=False)
    lay = Layout(8, 2, 4, 1, 16, zero=3, recompute=recompute)
    L, e, n = SPEC.n_layer, 2, 8
    link = cl.link(lay.world)
    unit = unit_forward_seconds(SPEC, lay, cl, "bf16")
    z1 = chunk_costs(SPEC, replace(lay, zero=1), cl, "bf16")
    z3 = chunk_costs(SPEC, lay, cl, "bf16")
    for r, layers in enumerate(stage_layers(SPEC, 4)):
        x = [rank_params(SPEC, [i], 2, 4) * e for i in layers]
        g = [link.all_gather(n, b) for b in x]
        rs = [link.reduce_scatter(n, b) for b in x]
        c = [unit["embed" if i == 0 else "head" if i == L + 1 else "block"] for i in layers]
        b = [(3 if recompute else 2) * t for t in c]
        if overlap:
            fwd, bwd = _overlapped_by_hand(g, rs, c, b)
        else:
            whole = rank_params(SPEC, layers, 2, 4) * e
            fwd = link.all_gather(n, whole)
            bwd = link.all_gather(n, whole) + link.reduce_scatter(n, whole)
        got = zero3_seconds(SPEC, lay, cl, "bf16", layers)
        assert got.forward == pytest.approx(fwd, rel=1e-12) and fwd > 0
        assert got.backward == pytest.approx(bwd, rel=1e-12) and bwd > 0
        assert z3[r].forward == pytest.approx(z1[r].forward + fwd, rel=1e-12)
        assert z3[r].backward == pytest.approx(z1[r].backward + bwd, rel=1e-12)
        assert z3[r].dp == pytest.approx(fwd + bwd, rel=1e-12) and z1[r].dp == 0.0
    t = simulate(SPEC, lay, cl, "bf16")
    star = max(range(4), key=lambda r: z3[r].forward + z3[r].backward)  # simulate's split
    assert t["dp"] == pytest.approx(16 * z3[star].dp, rel=1e-9)  # m of them, no flush sync
    assert zero3_seconds(SPEC, replace(lay, zero=1), cl, "bf16", [1, 2]) == (0.0, 0.0)


@pytest.mark.parametrize("overlap", [True, False])
def test_zero3_interleaved_seconds_are_per_chunk(overlap):
    """Interleaved 1F1B (v = 2) under ZeRO-3, dp 8 x tp 2 x pp 4: each of a rank's two
    chunks is a ``ZeroStage3`` of its own, so each chunk's forward and backward carry
    ``zero3_seconds`` of that chunk's layers alone, by the formula of the test above
    (ZeRO-1's costs plus these), not of the rank's; the step's dp part is m passes of both
    chunks of the bottleneck rank. Planned, not pruned (the engine runs it)."""
    from shardwise.planner.memory import cut, rank_params
    from shardwise.planner.simulate import chunk_costs, unit_forward_seconds

    cl = A100 if overlap else replace(A100, zero3_overlap=False)
    lay = Layout(8, 2, 4, 1, 16, "interleaved", 2, zero=3)
    assert prune_reason(SPEC, lay, cl, False) is None
    L, e, n = SPEC.n_layer, 2, 8
    link = cl.link(lay.world)
    unit = unit_forward_seconds(SPEC, lay, cl, "bf16")
    z1 = chunk_costs(SPEC, replace(lay, zero=1), cl, "bf16")
    z3 = chunk_costs(SPEC, lay, cl, "bf16")
    part = cut(SPEC, 8)
    assert len(z3) == 8
    for ch in range(8):  # chunk ch on rank ch % 4
        layers = list(part.layers(ch))
        x = [rank_params(SPEC, [i], 2, 4) * e for i in layers]
        g = [link.all_gather(n, b) for b in x]
        rs = [link.reduce_scatter(n, b) for b in x]
        c = [unit["embed" if i == 0 else "head" if i == L + 1 else "block"] for i in layers]
        if overlap:
            fwd, bwd = _overlapped_by_hand(g, rs, c, [2 * t for t in c])
        else:
            whole = rank_params(SPEC, layers, 2, 4) * e
            fwd = link.all_gather(n, whole)
            bwd = link.all_gather(n, whole) + link.reduce_scatter(n, whole)
        assert z3[ch].forward == pytest.approx(z1[ch].forward + fwd, rel=1e-12) and fwd > 0
        assert z3[ch].backward == pytest.approx(z1[ch].backward + bwd, rel=1e-12) and bwd > 0
        assert z3[ch].dp == pytest.approx(fwd + bwd, rel=1e-12)
    t = simulate(SPEC, lay, cl, "bf16")
    per_rank = [z3[r].forward + z3[r].backward + z3[r + 4].forward + z3[r + 4].backward
                for r in range(4)]
    star = max(range(4), key=per_rank.__getitem__)
    assert t["dp"] == pytest.approx(16 * (z3[star].dp + z3[star + 4].dp), rel=1e-9)


def _overlapped_by_hand(g, rs, c, b, exposed=0.0):
    """ZeRO-3's exposed (forward, backward) seconds of one stage by the documented formula:
    gathers g, reduce-scatters rs, forward compute c and backward compute b per unit; at
    least ``exposed`` of the gathers (forward) and of the gathers and reduce-scatters
    (backward), what prefetch cannot hide (``Cluster.zero3_exposed``, the GPU presets', for
    a group inside one node; the layouts of these tests span nodes: 0)."""
    k = len(g) - 1
    fwd = g[0] + sum(max(0.0, g[i] - c[i - 1]) for i in range(1, k + 1))
    bwd = g[k] + sum(max(0.0, (g[j - 1] if j else 0.0) + (rs[j + 1] if j < k else 0.0) - b[j])
                     for j in range(k + 1)) + rs[0]
    return max(fwd, exposed * sum(g)), max(bwd, exposed * (sum(g) + sum(rs)))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_zero3_pipeline_costs_more_comm_and_holds_less_than_zero1(schedule):
    """The same pipeline under ZeRO-1 and ZeRO-3: ZeRO-3 holds fewer bytes (a 1 / dp shard of
    the stage's parameters and gradients, two layers gathered at a time) and communicates
    more (every micro-batch gathers its stage twice). Its gathers delay the stages waiting
    on it, so the step grows by more than the busiest rank's m exposed seconds: the fill
    and drain carry them too."""
    from shardwise.planner.simulate import chunk_costs

    z1, z3 = (Layout(8, 2, 4, 1, 16, schedule, zero=z) for z in (1, 3))
    m1, t1 = _both(z1)
    m3, t3 = _both(z3)
    assert m3["total"] < m1["total"] and m3["activations"] == m1["activations"]
    assert m3["params"] < m1["params"] and m3["grads"] < m1["grads"]
    assert m3["gathered"] > 0 == m1["gathered"]
    assert t3["dp"] > t1["dp"] and t3["step"] > t1["step"]
    assert t3["compute"] == pytest.approx(t1["compute"], rel=1e-12)
    exposed = max(c.dp for c in chunk_costs(SPEC, z3, A100, "bf16"))
    assert t3["step"] - t1["step"] > 16 * exposed - t1["dp"]
    assert t3["bubble"] > t1["bubble"]


def test_search_plans_zero3_with_pipelines_and_interleaving():
    """ZeRO-3 x pp layouts, one chunk per rank or interleaved, are simulated like any (no
    reason prunes them: each chunk is its own ZeroStage3 in the engine)."""
    spec = NAMED["gpt2-350m"]
    feasible, pruned = plan(spec, A100, 8, 32, micro_batches=[2], zero=[1, 3], sp=[False],
                            recompute=[False], partitions=["layers"], exhaustive=True)
    z3pp = [c for c in feasible if c.layout.zero == 3 and c.layout.pp > 1]
    assert {c.layout.chunks_per_rank for c in z3pp} == {1, 2, 4}
    for c in z3pp:
        assert c.memory == memory_of(spec, c.layout, "bf16", compiled=A100.compiled)
        assert c.time == simulate(spec, c.layout, A100, "bf16")
    reasons = [p.reason for p in pruned if p.layout.zero == 3]
    assert not any("pipeline" in w or "chunks_per_rank" in w for w in reasons)


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


# --- context parallelism ----------------------------------------------------------------

LONG = NAMED["llama3-8b"].with_seq(32768)
H100 = PRESETS["dgx-h100"]


def _cp(cp, **kw):
    return Layout(2, 1, 1, 1, 4, cp=cp, **kw)


def test_more_cp_means_less_activation_memory_and_more_ring_traffic():
    from shardwise.planner.simulate import ring_bytes

    acts = {cp: memory_of(LONG, _cp(cp), "bf16")["activations"] for cp in (1, 2, 4, 8)}
    # every term per token, cut by cp; and the ring keeps K and V with their Hkv heads where
    # one process repeats them to all heads: 2 s h e (1 - Hkv / H) fewer bytes per block
    s, h, L = LONG.block_size, LONG.n_embd, LONG.n_layer
    unrepeated = L * 1 * s * h * 2 * 2 * (1 - LONG.kv_heads / LONG.n_head)
    assert unrepeated > 0  # Llama-3-8B: 8 kv heads of 32
    for cp in (2, 4, 8):
        assert acts[cp] == pytest.approx((acts[1] - unrepeated) / cp, rel=1e-9)
    # static bytes: the same weights; ZeRO shards them over dp x cp
    assert memory_of(LONG, _cp(4), "bf16")["params"] == memory_of(LONG, _cp(1), "bf16")["params"]
    assert memory_of(LONG, _cp(4, zero=1), "bf16")["optimizer"] == pytest.approx(
        memory_of(LONG, Layout(8, 1, 1, 1, 1, zero=1), "bf16")["optimizer"], rel=1e-6)
    # forward: 2 (cp - 1) / cp of the sequence's K/V bytes (2 s k e: K and V, k = Hkv D)
    kv = 2 * 32768 * LONG.kv_heads * (LONG.n_embd // LONG.n_head) * 2
    for cp in (1, 2, 4, 8):
        fwd, bwd = ring_bytes(LONG, _cp(cp), 2)
        assert fwd == pytest.approx((cp - 1) / cp * kv)
        assert bwd > fwd or cp == 1
    assert [ring_bytes(LONG, _cp(c), 2)[0] for c in (2, 4, 8)] == sorted(
        ring_bytes(LONG, _cp(c), 2)[0] for c in (2, 4, 8))


def test_a_sliding_window_prices_only_the_blocks_its_queries_see():
    """Mistral 7B at 32k tokens on cp 4 (W = 4096 = the chunk s / (2 cp)), by hand: a K/V
    block is 2 (K, V) x 8192 tokens x 8 heads x 128 x 2 bytes = 32 MiB; the engine moves
    only the neighbours' blocks (``ring_attention.kv_transfers``): forward 2 blocks on the
    middle ranks, where the ring moves 3; backward those 2 and the fp32 dK/dV (64 MiB) of
    the rank's own block from its 2 neighbours, where the ring moves 3 + 4; one message per
    hop distance (2, and 2 + 2 backward). Half the layers full (a Qwen2 / Gemma-3 mix): the
    ring's counts on those, the mean per block."""
    from shardwise.planner.simulate import ring_bytes, ring_seconds

    mistral, MiB = NAMED["mistral-7b"].with_seq(32768), 2 ** 20
    lay = Layout(2, 1, 1, 1, 4, cp=4)
    assert ring_bytes(mistral, lay, 2) == (64 * MiB, 64 * MiB + 2 * 64 * MiB)
    full = replace(mistral, attention_windows=())
    assert ring_bytes(full, lay, 2) == (96 * MiB, 96 * MiB + 4 * 64 * MiB)
    mixed = replace(mistral, attention_windows=(4096, None) * 16)
    assert ring_bytes(mixed, lay, 2) == (80 * MiB, 80 * MiB + 3 * 64 * MiB)
    link = _round().link(4)
    kv, dkv = link.p2p(32 * MiB), link.p2p(64 * MiB)
    assert ring_seconds(mistral, lay, _round(), 2) == pytest.approx((2 * kv, 2 * kv + 2 * dkv))
    assert ring_seconds(full, lay, _round(), 2) == pytest.approx((3 * kv, 3 * kv + 4 * dkv))
    # cp 8 (chunks of 2048): the two nearest ranks each side, 4 blocks; a window past the
    # sequence: the ring
    assert ring_bytes(mistral, Layout(2, 1, 1, 1, 4, cp=8), 2).forward == 4 * 16 * MiB
    assert ring_bytes(mistral.with_seq(4096), lay, 2) == ring_bytes(
        full.with_seq(4096), lay, 2)


def test_a_sliding_window_under_cp_prices_the_slowest_ranks_attention():
    """The layout balances causal attention, not a band: with W = c = 4096 (mistral-7b,
    32k tokens, cp 4) rank 0 scores its two diagonal triangles (c^2 / 2 each, about) and
    one band box with its neighbour's chunk, (c - 1)^2 (the rows and columns that see
    anything), ranks 1-3 two triangles and two boxes: the slowest's attention is priced at
    its pairs over its 2 c queries, 2 a pair (``planner.attention.FUSED_PAIR``: the price
    the causal triangle counted whole implies), about 3 c keys a query. Without a window,
    or one past the sequence, s (the same price: triangles and full boxes). (At cp = 1 the
    engine's chunks of 4096 queries: the first scores 4096 keys, the seven others 8191,
    masked: 2 a pair.) Packed documents mask the ring's diagonal boxes too."""
    from shardwise.planner.simulate import attention_gemm_flops, attention_keys

    mistral, c = NAMED["mistral-7b"].with_seq(32768), 4096
    slowest = 2 * (c * c // 2 * 2 + 2 * (c - 1) ** 2) / (2 * c)
    assert attention_keys(mistral, 4) == pytest.approx(slowest, rel=1e-12)
    assert attention_keys(mistral, 1) == 2 * (4096 + 7 * 8191) / 8
    assert attention_gemm_flops(mistral, 1, 4) == pytest.approx(
        4 * 32768 * slowest * 4096 / 4, rel=1e-12)
    assert attention_keys(mistral.with_seq(4096), 4) == 4096
    assert attention_keys(LONG, 4) == LONG.attn_keys == 32768
    # packed documents: the ring's two diagonal boxes a rank masked, scored whole (c^2 each
    # where the causal kernel scores c^2 / 2): c = s / 2 cp more keys a query
    packed = replace(LONG, attention_mask="block_causal")
    assert attention_keys(packed, 4) == 32768 + 4096
    assert attention_keys(packed, 1) == 2 * 32768  # one call, the (s, s) mask


def _round(kernels="shardwise"):
    """A cluster of round numbers for the formula tests: 8 GPUs a node, 100 GB/s and 2 us
    inside, 10 GB/s and 20 us across (``hardware.fabric``: a step costs alpha + bytes /
    bandwidth)."""
    from shardwise.planner.hardware import fabric

    return replace(FIXED_PRESETS["dgx-h100"], gpus_per_node=8, kernels=kernels,
                   intra=fabric("in", 100e9, 2e-6), inter=fabric("out", 10e9, 20e-6))


@pytest.mark.parametrize("tp,cp,kernels,precision,bw,alpha,width", [
    (1, 4, "shardwise", "bf16", 100e9, 2e-6, 1024),  # one node; grouped K/V: 8 heads x 128
    (2, 8, "shardwise", "bf16", 10e9, 20e-6, 1024),  # tp x cp = 16 ranks: across nodes
    (1, 2, "megatron-2021", "bf16", 100e9, 2e-6, 1024),  # Megatron's kernels pass the same
    (2, 2, "shardwise", "fp32", 100e9, 2e-6, 1024),  # fp32: dK/dV as wide as K/V
])
def test_ring_seconds_are_the_documented_formula(tp, cp, kernels, precision, bw, alpha, width):
    """``ring_seconds`` by hand: a K/V block is 2 mb (s / cp) k e / t bytes (K and V of a
    rank's tokens, k the width passed); forward cp - 1 messages of it, backward those again
    and cp messages of the fp32 dK/dV block (4 / e times the bytes), each message alpha +
    bytes / bandwidth on the link tp x cp ranks cross."""
    from shardwise.planner.memory import BYTES
    from shardwise.planner.simulate import ring_bytes, ring_seconds

    e = BYTES[precision]
    mb, s = 2, 32768  # LONG: llama3-8b, h = 4096, 8 key/value heads of 128
    lay = Layout(2, tp, 1, mb, 4, cp=cp)
    block = 2 * mb * (s // cp) * width * e / tp
    dkv = block * 4 / e
    fwd = (cp - 1) * (alpha + block / bw)
    bwd = (cp - 1) * (alpha + block / bw) + cp * (alpha + dkv / bw)
    got = ring_seconds(LONG, lay, _round(kernels), e)
    assert got.forward == pytest.approx(fwd, rel=1e-12)
    assert got.backward == pytest.approx(bwd, rel=1e-12)
    # and in terms of ring_bytes: one alpha per message, the bytes at the bandwidth
    nbytes = ring_bytes(LONG, lay, e)
    assert got.forward == pytest.approx((cp - 1) * alpha + nbytes.forward / bw, rel=1e-12)
    assert got.backward == pytest.approx((2 * cp - 1) * alpha + nbytes.backward / bw,
                                         rel=1e-12)
    assert ring_seconds(LONG, Layout(2, tp, 1, mb, 4), _round(kernels), e) == (0.0, 0.0)


def test_ring_traffic_hides_behind_attention_unless_the_link_is_slow():
    lay = Layout(1, 1, 1, 1, 2, cp=8)
    fast = simulate(LONG, lay, H100)
    assert fast["cp"] == 0.0  # 4096 queries x 32768 keys of attention per rank hide it
    slow_link = replace(H100, intra=replace(H100.intra, fixed=replace(
        H100.intra.fixed, beta_link=H100.intra.fixed.beta_link * 200)))
    slow = simulate(LONG, lay, slow_link)
    assert slow["cp"] > 0 and slow["step"] > fast["step"]
    assert simulate(LONG, Layout(1, 1, 1, 1, 2, cp=1), slow_link)["cp"] == 0.0
    # compute per rank falls with cp (s / cp tokens, 1 / cp of the score FLOPs)
    assert simulate(LONG, Layout(1, 1, 1, 1, 2, cp=4), H100)["compute"] < \
        simulate(LONG, Layout(1, 1, 1, 1, 2, cp=2), H100)["compute"]


def test_gradients_of_replicated_weights_are_reduced_over_dp_times_cp():
    a, b = simulate(LONG, Layout(2, 1, 1, 1, 4, cp=4), H100), \
        simulate(LONG, Layout(8, 1, 1, 1, 1), H100)
    assert a["dp"] == pytest.approx(b["dp"], rel=1e-12)  # one all-reduce over 8 replicas
    assert simulate(LONG, Layout(1, 1, 1, 1, 8, cp=8), H100)["dp"] > 0


def test_cp_is_searched_only_where_twice_it_divides_the_sequence():
    from shardwise.planner.search import cp_choices

    spec = NAMED["gpt2-124m"].with_seq(24)
    assert cp_choices(spec, 16) == [1, 2, 4]  # 2 x 8 does not divide 24
    feasible, _ = plan(spec, H100, 16, 32, micro_batches=[1], top=200, exhaustive=True)
    assert {c.layout.cp for c in feasible} == {1, 2, 4}
    assert "is not divisible by 2 x parallel.cp = 16" in prune_reason(
        spec, Layout(2, 1, 1, 1, 16, cp=8), H100, False)



def test_a_model_with_dropout_gets_no_context_parallelism(tmp_path):
    """The engine refuses cp > 1 with model.dropout > 0 (ring attention has no attention
    dropout): the search prunes those layouts with that reason, where the same model
    without dropout ranks cp first; a TOML's model.dropout reaches the spec; the emitted
    TOML keeps the dropout and cp = 1, and trains' config accepts it."""
    import tomllib

    from shardwise.cli.plan import emit_toml
    from shardwise.planner.search import cp_reason
    from shardwise.planner.specs import load_model

    spec = NAMED["llama2-7b"].with_seq(32768)
    plain, _ = plan(spec, H100, 16, 16, micro_batches=[1], top=3)
    assert plain[0].layout.cp > 1  # the same model without dropout: cp wins
    wet = replace(spec, dropout=0.1)
    feasible, pruned = plan(wet, H100, 16, 16, micro_batches=[1], top=3)
    assert feasible and all(c.layout.cp == 1 for c in feasible)
    why = [p for p in pruned if "model.dropout=0.1" in p.reason]
    assert why and all(p.layout.cp > 1 for p in why)
    assert cp_reason(wet, 1) is None and "ring attention" in cp_reason(wet, 2)
    assert "model.dropout" in prune_reason(wet, Layout(8, 1, 1, 1, 2, cp=2), H100, False)
    out = emit_toml(str(tmp_path / "best.toml"), "llama2-7b", wet, feasible[0].layout, 16,
                    "bf16")
    emitted = tomllib.loads(out.read_text())
    assert emitted["model"]["dropout"] == 0.1 and emitted["parallel"]["cp"] == 1
    assert "dropout" not in NAMED["llama2-7b"].model_table()  # named sizes: none
    toml = tmp_path / "m.toml"
    toml.write_text("[model]\nn_layer = 2\nn_head = 4\nn_embd = 64\nblock_size = 64\n"
                    "vocab_size = 256\ndropout = 0.25\n")
    assert load_model(str(toml)).dropout == 0.25
    assert load_model(str(toml), seq=128).dropout == 0.25
    assert load_model(str(toml)).with_seq(128).dropout == 0.25

# --- expert parallelism -------------------------------------------------------------------

MOE = NAMED["mixtral-8x7b"].with_seq(4096)


def test_mixtral_preset_counts_its_published_sizes():
    from shardwise.planner.specs import active_matmul_params

    m = NAMED["mixtral-8x7b"]
    assert m.params / 1e9 == pytest.approx(46.7, abs=0.05)  # Jiang et al. 2024
    active = m.params - m.n_layer * (m.expert_params - m.top_k * 3 * m.n_embd * m.expert_ffn)
    assert active / 1e9 == pytest.approx(12.9, abs=0.05)
    assert active_matmul_params(m) < m.n_embd * m.n_embd * 60


def test_more_ep_means_less_expert_memory_and_more_all_to_all_bytes():
    from shardwise.planner.memory import rank_expert_params
    from shardwise.planner.simulate import all_to_all_bytes

    per_block = MOE.expert_params
    layers = list(range(MOE.n_layer + 2))
    mems = {}
    for ep in (1, 2, 4, 8):
        lay = Layout(8, 1, 1, 1, 4, zero=1, ep=ep)
        assert rank_expert_params(MOE, layers, 1, ep) == MOE.n_layer * per_block // ep
        mems[ep] = memory_of(MOE, lay, "bf16")["total"]
        T = 4096  # tokens per micro-batch
        assert all_to_all_bytes(MOE, lay, 2) == pytest.approx(
            2 * T * MOE.top_k * MOE.n_embd * 2 * (ep - 1) / ep)
    assert mems[1] > mems[2] > mems[4] > mems[8]
    # the experts' bytes fall as 1 / ep: params of ep=1 minus ep=2 is half the experts
    p1 = memory_of(MOE, Layout(8, 1, 1, 1, 4, ep=1), "bf16")["params"]
    p2 = memory_of(MOE, Layout(8, 1, 1, 1, 4, ep=2), "bf16")["params"]
    assert p1 - p2 == MOE.n_layer * per_block // 2 * 2  # bf16: 2 bytes each


@pytest.mark.parametrize("dp,tp,pp,cp,ep,mb,bw,alpha", [
    (4, 1, 1, 1, 4, 1, 100e9, 2e-6),  # ep 4 inside a node
    (8, 1, 2, 1, 8, 1, 10e9, 20e-6),  # ep 8 x pp 2 = 16 ranks: across nodes
    (4, 1, 1, 2, 2, 2, 100e9, 2e-6),  # cp 2 halves a rank's tokens, mb 2 doubles them
    (2, 2, 1, 2, 2, 1, 100e9, 2e-6),  # ep x cp x tp = 8: still one node
])
def test_all_to_all_seconds_are_the_documented_formula(dp, tp, pp, cp, ep, mb, bw, alpha):
    """``all_to_all_seconds`` by hand: dispatch and combine each send a rank's T k token
    copies of h values (T = mb s / cp), (ep - 1) / ep of them to the ep - 1 others in
    ep - 1 pairwise steps: 2 ((ep - 1) alpha + (ep - 1) / ep T k h e / bandwidth), on the
    link ep x pp x cp x tp ranks cross."""
    from shardwise.planner.simulate import all_to_all_bytes, all_to_all_seconds

    e, s, k, h = 2, 4096, 2, 4096  # MOE: mixtral-8x7b at 4096, top-2, width 4096
    lay = Layout(dp, tp, pp, mb, 4, ep=ep, cp=cp)
    T = mb * s // cp
    want = 2 * ((ep - 1) * alpha + (ep - 1) / ep * T * k * h * e / bw)
    got = all_to_all_seconds(MOE, lay, _round(), e)
    assert got == pytest.approx(want, rel=1e-12)
    # and in terms of all_to_all_bytes (both passes' messages: 2 (ep - 1) alphas)
    assert got == pytest.approx(2 * (ep - 1) * alpha + all_to_all_bytes(MOE, lay, e) / bw,
                                rel=1e-12)
    assert all_to_all_seconds(MOE, replace(lay, ep=1), _round(), e) == 0.0
    assert all_to_all_seconds(NAMED["llama2-7b"], lay, _round(), e) == 0.0  # no experts


def test_ep_prices_all_to_all_and_reduces_expert_gradients_over_dp_over_ep():
    one, four = Layout(8, 1, 1, 1, 4, ep=1), Layout(8, 1, 1, 1, 4, ep=4)
    t1, t4 = simulate(MOE, one, H100), simulate(MOE, four, H100)
    assert t1["ep"] == 0.0 and t4["ep"] > 0
    assert t4["dp"] < t1["dp"]  # the experts' gradients: 1 / ep of them, over 2 ranks not 8
    eight = simulate(MOE, Layout(8, 1, 1, 1, 4, ep=8), H100)
    assert eight["ep"] > t4["ep"]
    # across nodes (ep over 16 ranks of 8-GPU nodes) the all-to-all is slower per byte
    wide = simulate(MOE, Layout(16, 1, 1, 1, 2, ep=8), H100)
    assert wide["ep"] == pytest.approx(eight["ep"] / 2, rel=1e-9)  # half the micro-batches
    across = Layout(8, 1, 2, 1, 4, ep=8)  # ep x pp = 16 ranks: InfiniBand
    assert simulate(MOE, across, H100)["ep"] > eight["ep"]


def test_ep_is_searched_only_for_a_mixture_of_experts():
    dense, _ = plan(NAMED["llama2-7b"], H100, 16, 32, micro_batches=[1], top=5)
    assert all(c.layout.ep == 1 for c in dense)
    moe, pruned = plan(MOE, H100, 16, 32, micro_batches=[1], top=400, exhaustive=True)
    assert {c.layout.ep for c in moe} > {1}
    assert any(c.layout.sp and c.layout.tp > 1 for c in moe)  # SP with experts (once pruned)
    assert any(c.layout.zero == 3 and c.layout.ep > 1 for c in moe)  # modelled now
    assert {c.layout.cp for c in moe} > {1}  # context parallelism with experts is searched


def test_the_optimizer_of_experts_shards_over_dp_ep_and_cp_as_their_memory():
    """ZeRO spreads the expert masters over (dp / ep) x cp ranks: AdamW's time falls with cp
    as the optimizer bytes do (they once kept the dp / ep share)."""
    from shardwise.planner.memory import stage_layers
    from shardwise.planner.simulate import optimizer_seconds

    layers = stage_layers(MOE, 1, 1)[0]
    base = Layout(4, 1, 1, 1, 1, zero=1, ep=2)
    # AdamW's bytes, less the host's fixed seconds per step (hardware.STEP_S)
    t = [optimizer_seconds(MOE, replace(base, cp=c), H100, layers) - H100.step_s
         for c in (1, 2, 4)]
    mem = [memory_of(MOE, replace(base, cp=c), "bf16")["optimizer"] for c in (1, 2, 4)]
    assert t[1] == pytest.approx(t[0] / 2, rel=1e-9) and t[2] == pytest.approx(t[0] / 4, rel=1e-9)
    assert mem[1] == pytest.approx(mem[0] / 2, rel=1e-3)


# --- FP8 ----------------------------------------------------------------------------------

def test_fp8_speeds_up_gemms_only_where_the_gpu_has_fp8():
    assert [k for k, c in PRESETS.items() if c.fp8_flops] == ["dgx-h100", "dgx-h200"]
    assert [k for k, c in FIXED_PRESETS.items() if c.fp8_flops] == ["dgx-h100", "dgx-h200"]
    lay = Layout(8, 1, 1, 1, 4)
    for cl in (H100, FIXED_PRESETS["dgx-h100"]):
        bf16, fp8 = simulate(SPEC, lay, cl), simulate(SPEC, replace(lay, fp8=True), cl)
        assert fp8["compute"] < bf16["compute"]
        assert fp8["compute"] > bf16["compute"] / 2  # attention core, head, memory-bound: bf16
    assert H100.ops.gemm(1e12, fp8=True) == pytest.approx(H100.ops.gemm(1e12) / 2, rel=1e-4)
    a = simulate(SPEC, lay, A100)
    assert simulate(SPEC, replace(lay, fp8=True), A100)["step"] == a["step"]
    assert "no FP8" in prune_reason(SPEC, replace(lay, fp8=True), A100, False)
    asked, pruned = plan(SPEC, A100, 8, 32, micro_batches=[1], top=3, fp8=(False, True))
    assert not any(c.layout.fp8 for c in asked) and any("no FP8" in p.reason for p in pruned)
    asked, _ = plan(SPEC, H100, 8, 32, micro_batches=[1], top=3, fp8=(False, True))
    assert asked[0].layout.fp8


def test_selective_recomputation_drops_exactly_the_score_term():
    """Korthikanti et al. 2022, eq. 2 and sec. 5: per layer 34 s b h + 5 a s^2 b bytes
    without recomputation (tp = 1), 34 s b h with the attention core recomputed."""
    from shardwise.planner.memory import block_activation_bytes

    s, b, h, a = 2048, 1, 5120, 40
    assert block_activation_bytes(MEGATRON, b, s, h, a, 1, False) == 34 * s * b * h + \
        5 * a * s * s * b
    sel = replace(MEGATRON, scores=0.0)  # what activation_bytes(selective=True) uses
    assert block_activation_bytes(sel, b, s, h, a, 1, False) == 34 * s * b * h


def test_megatron_2021_pipeline_sends_block_the_compute_stream():
    """With Megatron-LM 2021's kernels a pipeline send is the sender's time (its
    scatter/gather: 1 / t of the activation across, an all-gather inside the node), counted
    in ``pp``; shardwise's sends travel beside compute."""
    from shardwise.planner.simulate import blocking_p2p, megatron_send_seconds

    spec = NAMED["megatron-39b"]
    meg = per_op(FIXED_PRESETS["dgx-a100-80gb"], "megatron-2021")
    lay = Layout(8, 8, 4, 1, 16)
    assert blocking_p2p(meg, lay) and not blocking_p2p(A100, lay)
    assert not blocking_p2p(replace(meg, blocking_sends=False), lay)  # the ablation's switch
    assert not blocking_p2p(meg, replace(lay, pp=1))
    send = megatron_send_seconds(spec, lay, meg, 2)
    whole = meg.link(lay.tp * lay.pp).p2p(1 * 2048 * 8192 * 2)
    assert 0 < send < whole  # scatter/gather: an eighth across the nodes
    t = simulate(spec, lay, meg, "bf16")
    # every micro-batch sends forward from 3 of 4 stages and back from 3: the busiest rank
    # (stage 1 or 2) blocks 2 m sends at least
    assert t["pp"] >= 2 * lay.micro_batches * send * (1 - 1e-9)
    assert sum(t[k] for k in t if k != "step") == pytest.approx(t["step"], rel=1e-9)


@pytest.mark.parametrize("tp,ep,sp", [(1, 1, False), (1, 2, False), (1, 4, False),
                                     (2, 2, False), (2, 2, True)])
def test_a_configured_mixture_of_experts_is_counted_as_the_engine_shards_it(tmp_path, tp, ep,
                                                                             sp):
    """A TOML Llama with 4 experts: the rank's elements, experts among them, equal what the
    engine builds (``predict_rank`` on meta) for every tp x ep, with sequence parallelism
    too (each mixture one SP region: the same parameters)."""
    from shardwise.engine.memory import predict_rank
    from shardwise.planner.memory import rank_expert_params, rank_params
    from shardwise.planner.specs import load_model

    path = tmp_path / "moe.toml"
    path.write_text('[model]\nkind = "llama"\nn_layer = 2\nn_head = 4\nn_embd = 64\n'
                    'block_size = 64\nvocab_size = 128\nn_experts = 4\ntop_k = 2\n')
    spec = load_model(str(path))
    assert spec.moe and spec.n_experts == 4 and spec.top_k == 2
    layers = list(range(spec.n_layer + 2))
    want = predict_rank(spec.model(), dp=4, tp=tp, ep=ep, zero=0, precision="fp32",
                        sequence_parallel=sp)["params"]
    assert 4 * rank_params(spec, layers, tp, 1, ep) == want
    assert rank_expert_params(spec, layers, tp, ep) == spec.n_layer * spec.expert_params // (tp * ep)


@pytest.mark.parametrize("overlap", [True, False])
def test_zero3_ep_seconds_are_the_documented_formula(overlap):
    """``zero3_seconds`` by hand for each stage of a dp 8 x ep 4 x pp 2 ZeRO-3 layout of
    Mixtral 8x7B: a block's gather is its dense part's over dp (n = 8) then its E / ep
    experts' over dp / ep (n_x = 2) on the same stream, g_i = g_8(dense_i) + g_2(experts_i),
    likewise r_i; then the formula of ``test_zero3_pipeline_seconds_are_the_documented_
    formula`` (without overlap: the stage's dense and expert bytes, two units per block)."""
    from shardwise.planner.memory import rank_expert_params, rank_params, stage_layers
    from shardwise.planner.simulate import chunk_costs, unit_forward_seconds

    cl = H100 if overlap else replace(H100, zero3_overlap=False)
    lay = Layout(8, 1, 2, 1, 8, zero=3, ep=4)
    L, e, n, nx = MOE.n_layer, 2, 8, 2
    link = cl.link(lay.world)
    unit = unit_forward_seconds(MOE, lay, cl, "bf16")
    z1 = chunk_costs(MOE, replace(lay, zero=1), cl, "bf16")
    z3 = chunk_costs(MOE, lay, cl, "bf16")

    def parts(ls):
        x = rank_expert_params(MOE, ls, 1, 4) * e
        return rank_params(MOE, ls, 1, 2, 4) * e - x, x

    for r, layers in enumerate(stage_layers(MOE, 2)):
        xs = [parts([i]) for i in layers]
        assert all(x > 0 for i, (_, x) in zip(layers, xs) if 1 <= i <= L)
        g = [link.all_gather(n, d) + link.all_gather(nx, x) for d, x in xs]
        rs = [link.reduce_scatter(n, d) + link.reduce_scatter(nx, x) for d, x in xs]
        c = [unit["embed" if i == 0 else "head" if i == L + 1 else "block"] for i in layers]
        b = [2 * t for t in c]
        if overlap:
            fwd, bwd = _overlapped_by_hand(g, rs, c, b)
        else:
            d, x = parts(layers)
            fwd = link.all_gather(n, d) + link.all_gather(nx, x)
            bwd = (link.all_gather(n, d) + link.all_gather(nx, x) + link.reduce_scatter(n, d)
                   + link.reduce_scatter(nx, x))
        got = zero3_seconds(MOE, lay, cl, "bf16", layers)
        assert got.forward == pytest.approx(fwd, rel=1e-12) and fwd > 0
        assert got.backward == pytest.approx(bwd, rel=1e-12) and bwd > 0
        assert z3[r].forward == pytest.approx(z1[r].forward + fwd, rel=1e-12)
        assert z3[r].backward == pytest.approx(z1[r].backward + bwd, rel=1e-12)
        # the memo keys ep: the same layout at ep 1 gathers all E experts over dp
        memo: dict = {}
        zero3_seconds(MOE, lay, cl, "bf16", layers, memo)
        one = zero3_seconds(MOE, replace(lay, ep=1), cl, "bf16", layers, memo)
        assert one == zero3_seconds(MOE, replace(lay, ep=1), cl, "bf16", layers) != got


def test_zero3_with_ep_is_planned():
    """Mixtral 8x7B on 64 H100s: ZeRO-3 x ep layouts are no longer pruned as unmodelled,
    and priced ones hold less than the same layout under ZeRO-1."""
    best, pruned = plan(MOE, H100, 64, 256, micro_batches=[1], top=5)
    assert not any("does not model" in p.reason for p in pruned)
    lay = Layout(64, 1, 1, 1, 4, zero=3, ep=8)
    assert prune_reason(MOE, lay, H100, False) is None
    m3, m1 = memory_of(MOE, lay, "bf16"), memory_of(MOE, replace(lay, zero=1), "bf16")
    assert m3["total"] < m1["total"] and m3["gathered"] > 0
    t3, t1 = simulate(MOE, lay, H100, "bf16"), simulate(MOE, replace(lay, zero=1), H100, "bf16")
    assert t3["step"] > t1["step"]  # every micro-batch gathers the rank's units twice


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2)])
def test_mixed_dense_and_moe_blocks_are_counted_block_by_block(tmp_path, tp, ep):
    """A TOML Llama of 3 blocks, block 0 dense (``model.dense_layers``, DeepSeek's
    first_k_dense_replace) and 4 experts in the others: the planner's parameters per
    pipeline rank (experts among them) equal what the engine builds (``predict_rank`` on
    meta) for each stage of a pp2 cut by parameters, both from the description and from
    the closed forms (the same sizes, no description); the whole count equals the model's;
    the FLOPs per token (3 x ``block_flops`` x L + the head's) equal the description's
    (``flops_per_token``, a token's top_k of E experts in the mixtures only; less its
    6 x the norms' weights, which the planner's GEMMs do not count); the mean
    block's prices lie between a dense block's and a mixture's."""
    from shardwise.engine.memory import predict_rank
    from shardwise.planner.memory import rank_expert_params, rank_params, stage_layers
    from shardwise.planner.simulate import block_costs, block_flops
    from shardwise.planner.specs import load_model

    path = tmp_path / "mixed.toml"
    path.write_text('[model]\nkind = "llama"\nn_layer = 3\nn_head = 4\nn_embd = 64\n'
                    'block_size = 64\nvocab_size = 128\nn_experts = 4\ntop_k = 2\n'
                    'ffn_hidden = 96\nmoe_ffn_hidden = 32\ndense_layers = [0]\n'
                    'tie_weights = false\n')
    spec = load_model(str(path))
    closed = replace(spec, description=None, n_params=None)
    assert spec.mixed and spec.dense_layers == (0,) and spec.moe_share == pytest.approx(2 / 3)
    assert closed.params == spec.params
    d = spec.model()
    for stage, layers in enumerate(stage_layers(spec, 2, by="params")):
        want = predict_rank(d, dp=4, pp=2, pp_rank=stage, tp=tp, ep=ep, zero=0,
                            precision="fp32", partition_by="params")["params"]
        assert 4 * rank_params(spec, layers, tp, 2, ep) == want, (stage, layers)
        assert rank_params(closed, layers, tp, 2, ep) == rank_params(spec, layers, tp, 2, ep)
        moe = sum(1 for i in layers if i in (2, 3))
        assert rank_expert_params(spec, layers, tp, ep) == \
            rank_expert_params(closed, layers, tp, ep) == moe * spec.expert_params // (tp * ep)
    norms = 64 * (2 * 3 + 1)  # counted by flops_per_token (6 N), not by the planner's GEMMs
    for s in (spec, closed):
        per_token = 3 * (3 * block_flops(s, 1) + 2 * 64 * 64 * 128) / 64
        assert per_token == pytest.approx(d.flops_per_token(d.build()) - 6 * norms, rel=1e-12)
    lay = Layout(1, 1, 1, 1, 1)
    mean, one, dense = (block_costs(s, lay, H100, "bf16").block
                        for s in (spec, spec.part("moe"), spec.part("dense")))
    assert mean == pytest.approx((2 * one + dense) / 3, rel=1e-12) and dense != one


def test_deepseek_presets_count_transformers_parameters():
    """``deepseek-v2-lite`` and ``deepseek-v3`` (DeepSeek's released config.json values)
    have exactly the parameters of ``transformers``' ``DeepseekV2ForCausalLM`` /
    ``DeepseekV3ForCausalLM`` of those configs built on the meta device (V2-Lite 15.7B;
    V3 671.0B without its multi-token-prediction layer, 37.6B a token meets: the paper's
    37B activated), and the FLOPs count MLA's attention (Q K^T over 192 features, P V over
    128) and a token's 8 of 256 experts in the 58 mixtures."""
    import torch
    import transformers

    from shardwise.planner.simulate import block_flops

    common = dict(kv_lora_rank=512, qk_rope_head_dim=64,
                  v_head_dim=128, qk_nope_head_dim=128, tie_word_embeddings=False)
    configs = {
        "deepseek-v2-lite": transformers.DeepseekV2Config(
            vocab_size=102400, hidden_size=2048, intermediate_size=10944,
            moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
            num_key_value_heads=16,
            n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
            first_k_dense_replace=1, q_lora_rank=None, topk_method="greedy", **common),
        "deepseek-v3": transformers.DeepseekV3Config(
            vocab_size=129280, hidden_size=7168, intermediate_size=18432,
            moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
            num_key_value_heads=128,
            n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
            topk_group=4, first_k_dense_replace=3, q_lora_rank=1536,
            routed_scaling_factor=2.5, **common)}
    for name, config in configs.items():
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(config)
        spec = NAMED[name]
        assert spec.params == sum(p.numel() for p in hf.parameters()), name
    v3 = NAMED["deepseek-v3"]
    assert v3.params / 1e9 == pytest.approx(671.0, abs=0.05)
    moe = sum(1 for i in range(v3.n_layer) if v3.is_moe_block(i))
    active = v3.params - moe * (v3.expert_params - v3.top_k * 3 * v3.n_embd * v3.expert_ffn)
    assert moe == 58 and active / 1e9 == pytest.approx(37.55, abs=0.01)
    s, H = v3.block_size, 128
    per_token = 3 * (v3.n_layer * block_flops(v3, 1) + 2 * s * 7168 * 129280) / s
    norms = 7168 * (2 * 61 + 1) + 61 * (1536 + 512)
    moe_experts = moe * v3.expert_params
    want = 6 * (v3.params - 129280 * 7168 - norms - moe_experts * (1 - 8 / 256)) \
        + 6 * s * v3.n_layer * H * (192 + 128)
    assert per_token == pytest.approx(want, rel=1e-9)
