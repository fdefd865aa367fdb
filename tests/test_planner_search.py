"""The planner's fast search against the slow one it replaced (no processes, seconds).

- the predictions (memory per GPU, step time and its split) of 646 layouts equal those the
  old code recorded (``tests/data/planner_baseline.json``, commit 2164532);
- the pieces that made it fast equal what they replace: the numpy stage cut
  (``fast_balanced``) and ``balanced``; the compute orders as arrays and
  ``schedules.compute_order``; ``walk_fast`` and the instruction-by-instruction ``walk``;
- the lower bound never exceeds the simulated step, and the bounded search returns the
  same best layouts as simulating every feasible one, at 64 to 256 GPUs;
- every layout of the space is accounted for: simulated, or pruned with a reason.
"""

import json
import random
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from helpers import assert_one_line_exit_2
from shardwise.parallel.pipeline.partition import balanced
from shardwise.parallel.pipeline.schedules import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    compute_order,
    schedule,
)
from shardwise.planner.hardware import FIXED_PRESETS, PRESETS
from shardwise.planner.memory import fast_balanced, layer_weights
from shardwise.planner.search import Bounds, enumerate_layouts, lower_bound, memory_of, plan
from shardwise.planner.simulate import ChunkCost, Layout, _orders, simulate, walk, walk_fast
from shardwise.planner.specs import NAMED

BASELINE = Path(__file__).parent / "data" / "planner_baseline.json"


def test_predictions_equal_the_recorded_ones():
    """The recorded model: the fixed efficiency of the presets (``FIXED_PRESETS``; the
    per-operation model came after the recording) and ZeRO-3's collectives without overlap
    (``zero3_overlap=False``; the overlap came after it too). ZeRO-3's gathered units in
    flight (``memory.gathered_bytes``) came after it as well: the recorded total is the
    total less them (0 but for ZeRO-3)."""
    from dataclasses import replace

    rows = json.loads(BASELINE.read_text())
    assert len(rows) == 646
    for row in rows:
        spec = NAMED[row["model"]]
        cluster = replace(FIXED_PRESETS[row["cluster"]], zero3_overlap=False)
        lay = Layout(**row["layout"])
        mem = memory_of(spec, lay, cluster.precision)
        gathered = mem.pop("gathered")
        assert gathered == 0 or lay.zero == 3
        assert mem == {**row["memory"], "total": mem["total"]}, lay
        assert mem["total"] == pytest.approx(row["memory"]["total"] + gathered, rel=1e-15), lay
        t = simulate(spec, lay, cluster)
        assert set(t) == set(row["time"]) | {"cp", "ep"}  # the parts recorded, and cp and
        assert t["cp"] == t["ep"] == 0.0  # ep's, which came after (none in these layouts)
        for k, old in row["time"].items():
            assert t[k] == pytest.approx(old, rel=1e-9, abs=1e-12 * row["time"]["step"]), (lay, k)


def test_fast_cut_is_balanced():
    rng = random.Random(0)
    cases = [(layer_weights(spec, by), parts) for spec in NAMED.values()
             for by in ("layers", "params") for parts in (1, 2, 3, 5, 8, 16, 35, 64)
             if parts <= spec.n_layer + 2]
    cases += [([float(rng.choice([1, 2, 3, 7, 100])) for _ in range(n)], rng.randint(1, n))
              for n in (rng.randint(1, 40) for _ in range(200))]
    cases += [([0.5, 1.25, 3.0], 2)]  # fractional weights: balanced() itself
    for w, parts in cases:
        assert fast_balanced(w, parts) == balanced(w, parts), (w, parts)


@pytest.mark.parametrize("p,m,v", [(1, 4, 1), (2, 1, 1), (3, 5, 1), (4, 2, 1), (4, 8, 1),
                                   (2, 4, 2), (4, 8, 2), (4, 4, 4), (3, 6, 4), (8, 16, 2)])
def test_orders_are_the_schedules(p, m, v):
    bwd, chunk = _orders(p, m, v)[:2]
    ref = compute_order("interleaved" if v > 1 else "1f1b", p, m, v)
    for r in range(p):
        assert [(bool(b), int(c)) for b, c in zip(bwd[r], chunk[r])] == \
            [(not isinstance(op, Forward), op.chunk) for op in ref[r]]


@pytest.mark.parametrize("p,m,v", [(2, 3, 1), (4, 8, 1), (4, 2, 1), (3, 6, 2), (4, 8, 4),
                                   (8, 8, 2)])
def test_walk_fast_is_the_walk(p, m, v):
    rng = random.Random(p * 100 + m * 10 + v)
    kind = "interleaved" if v > 1 else "1f1b"
    sched = schedule(kind, p, m, v)
    for p2p in (0.0, 0.3, 5.0):
        costs = []
        for _ in range(p * v):
            f = rng.uniform(0.5, 3.0)
            tp = rng.uniform(0, 0.2)
            costs.append(ChunkCost(f, 2 * f + rng.uniform(0, 1), tp, 2 * tp, 0.0, 0.0,
                                   0.0, 0.0, 0.0))
        slow, fast = walk(sched, costs, p2p), walk_fast(p, m, v, costs, p2p)
        assert fast.busy == slow.busy and fast.tp == slow.tp  # summed in the walk's order
        assert fast.end == pytest.approx(slow.end, rel=1e-12)
        assert fast.events == [] and len(slow.events) == 2 * m * p * v


@pytest.mark.parametrize("kind,p,m,v", [("gpipe", 4, 6, 1), ("1f1b", 4, 8, 1),
                                        ("interleaved", 4, 8, 2), ("pipedream", 3, 5, 1),
                                        ("naive", 2, 3, 1), ("zb1p", 4, 8, 1), ("zbv", 4, 8, 2),
                                        ("dualpipev", 4, 8, 2)])
def test_the_walk_and_the_schedules_share_one_timer(kind, p, m, v):
    """With free transfers, the planner's walk of a schedule's instruction lists times every
    compute where ``schedules.time_orders`` times its compute orders with the same costs
    (both run ``schedules.time_lists``)."""
    from shardwise.parallel.pipeline.schedules import time_orders

    rng = random.Random(p * 100 + m * 10 + v)
    fwd = [rng.uniform(0.5, 3.0) for _ in range(p * v)]
    bwd = [2 * f + rng.uniform(0, 1) for f in fwd]
    costs = [ChunkCost(f, b, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0) for f, b in zip(fwd, bwd)]
    ideal = time_orders(compute_order(kind, p, m, v), p, v, fwd, bwd)
    events = walk(schedule(kind, p, m, v), costs, 0.0).events
    split = sum(isinstance(op, BackwardInput) for order in compute_order(kind, p, m, v)
                for op in order)  # F, B, W where the backward is split
    assert len(events) == len(ideal) == 2 * m * p * v + split
    assert split == (m * p * v if kind in ("zb1p", "zbv") else 0) or kind == "dualpipev"
    ops = {c.__name__: c for c in (Forward, Backward, BackwardInput, BackwardWeight)}
    for e in events:
        op = ops[e["kind"]](e["mb"], e["chunk"])
        assert (e["start"], e["end"]) == ideal[op], op


def test_simulate_refuses_what_prune_reason_refuses():
    """``simulate`` on a layout ``prune_reason`` rejects raises ``ValueError`` with the
    reason (before: the interleaved layout below raised ``IndexError`` in ``_orders``, and
    the others returned a step time for a layout the engine cannot run)."""
    from dataclasses import replace

    from shardwise.planner.search import prune_reason

    spec, h100 = NAMED["llama3-8b"], PRESETS["dgx-h100"]
    lay = Layout(dp=1, tp=1, pp=8, micro_batch_size=1, micro_batches=4,
                 schedule="interleaved", chunks_per_rank=2)
    with pytest.raises(ValueError, match="parallel.micro_batches=4 must be a multiple of "
                                         "parallel.pp=8"):
        simulate(spec, lay, h100)
    seen = set()
    for lay, why in enumerate_layouts(spec, 16, 24, micro_batches=[1], cp=[1, 2],
                                      selective=(False, True)):
        why = why or prune_reason(spec, lay, h100, True)
        kind = why.split(" ")[0] if why else None
        if kind == "ZeRO":  # same as ZeRO-0, priced so (below)
            continue
        if why is None or kind in seen or lay.micro_batch_size == 0:
            continue
        seen.add(kind)
        with pytest.raises(ValueError) as err:
            simulate(spec, lay, h100)
        assert why in str(err.value), lay
    assert len(seen) >= 3, seen
    a100 = PRESETS["dgx-a100-80gb"]  # pruned as the same as another layout: priced as it
    lay = Layout(8, 1, 1, 1, 4)
    assert simulate(spec, replace(lay, fp8=True), a100) == simulate(spec, lay, a100)
    lay = Layout(1, 8, 2, 1, 32)
    assert simulate(spec, replace(lay, zero=1), h100) == simulate(spec, lay, h100)


def test_cost_tuples_carry_their_names():
    """The prices that cross functions are named tuples (their units in the field docs):
    a field reads what its position held, and the composed numbers agree with them."""
    from shardwise.planner.simulate import (
        BlockCosts,
        DpSeconds,
        Ops,
        RingBytes,
        RingSeconds,
        _rank_comm,
        block_costs,
        block_ops,
        chunk_costs,
        dp_seconds,
        ring_bytes,
        ring_seconds,
    )

    spec, cluster = NAMED["llama3-8b"].with_seq(32768), PRESETS["dgx-h100"]
    lay = Layout(2, 2, 2, 1, 4, cp=2, zero=1)
    ops = block_ops(spec, 1, 2, False, cluster.kernels, 2, 2)
    assert type(ops) is Ops and ops.gemms is ops[0] and ops.moves is ops[1]
    rb, rs = ring_bytes(spec, lay, 2), ring_seconds(spec, lay, cluster, 2)
    assert type(rb) is RingBytes and type(rs) is RingSeconds
    assert 0 < rb.forward < rb.backward and 0 < rs.forward < rs.backward
    blk = block_costs(spec, lay, cluster, "bf16")
    assert type(blk) is BlockCosts and blk.n_sync == 2 and blk.tp > 0 and blk.attention > 0
    assert blk.cp_forward == max(0.0, rs.forward - blk.attention)
    assert blk.cp_backward == max(0.0, rs.backward - 2 * blk.attention)
    costs = chunk_costs(spec, lay, cluster, "bf16")
    for c in costs:
        assert c._fields == ("forward", "backward", "tp_forward", "tp_backward",
                             "wait_forward", "wait_backward", "cp", "ep", "pp", "dp")
        assert c.forward > c.tp_forward > 0 and c.backward > c.tp_backward > 0
    dp = dp_seconds(spec, lay, cluster, "bf16", [0, 1, 2])
    assert type(dp) is DpSeconds and dp.after > 0 and dp._fields == ("after",)
    comm = _rank_comm(costs, 0, lay)
    assert comm.cp == 4 * sum(c.cp for c in costs[::2]) and comm.ep == comm.pp == comm.dp == 0.0
    w = walk_fast(2, 4, 1, costs, 0.0)
    assert len(w.end) == len(w.busy) == len(w.tp) == 2 and w.events == []


# megatron-18b repeats gpt3-13b's case (a GPT on the same DGX A100 preset), twice the GPUs
# and batch, and llama2-70b on 256 H100s llama3-8b's on 64 (GQA, the H100 preset): slow
# (the exhaustive searches take 13 s and 43 s of one core; llama3-8b's 13.5 s, gpt3-13b's
# 16 s), and gpt3-13b's too since llama3-8b's exercises the same bound (make test's time)
CASES = [pytest.param("gpt3-13b", "dgx-a100-80gb", 64, 128, marks=pytest.mark.slow),
         pytest.param("megatron-18b", "dgx-a100-80gb", 128, 256, marks=pytest.mark.slow),
         ("llama3-8b", "dgx-h100", 64, 128),
         pytest.param("llama2-70b", "dgx-h100", 256, 256, marks=pytest.mark.slow)]


@pytest.mark.parametrize("name,cl,world,batch", CASES)
def test_bounded_search_finds_the_exhaustive_best(name, cl, world, batch):
    spec, cluster = NAMED[name], PRESETS[cl]
    space = {"micro_batches": [1, 2, 4]}
    every, _ = plan(spec, cluster, world, batch, exhaustive=True, **space)
    fast, pruned = plan(spec, cluster, world, batch, top=5, **space)
    assert len(every) > 50 and len(fast) < len(every)
    key = lambda c: (c.layout, c.time["step"])
    assert [key(c) for c in fast[:5]] == [key(c) for c in every[:5]]
    b = Bounds(spec, cluster, cluster.precision)
    for c in every:  # the bound holds for every layout
        assert lower_bound(b, c.layout) <= c.time["step"] * (1 + 1e-9), c.layout
    bounded = [p for p in pruned if "lower bound" in p.reason]
    assert len(bounded) == len(every) - len(fast)


def test_the_search_prices_zero_bubble_schedules():
    """Asked for zb1p and zbv, the bounded search walks their lists, still finds the
    exhaustive best, its bound holds for them, and each beats 1F1B at the same sizes and
    micro-batches somewhere (not everywhere: zbv makes twice the transfers, and the greedy
    orders, built on equal costs, lose to 1F1B where B and W differ much)."""
    spec, cluster = NAMED["gpt3-13b"], PRESETS["dgx-a100-80gb"]
    space = {"micro_batches": [1, 2, 4], "schedules": ("1f1b", "zb1p", "zbv"),
             "zero": (0, 1), "sp": (False,), "partitions": ("layers",)}
    every, _ = plan(spec, cluster, 16, 32, exhaustive=True, **space)
    fast, _ = plan(spec, cluster, 16, 32, top=5, **space)
    key = lambda c: (c.layout, c.time["step"])
    assert [key(c) for c in fast[:5]] == [key(c) for c in every[:5]]
    b = Bounds(spec, cluster, cluster.precision)
    by_layout = {c.layout: c.time["step"] for c in every}
    kinds = {c.layout.schedule for c in every}
    assert {"zb1p", "zbv"} <= kinds
    faster, twins = {"zb1p": 0, "zbv": 0}, {"zb1p": 0, "zbv": 0}
    for c in every:
        assert lower_bound(b, c.layout) <= c.time["step"] * (1 + 1e-9), c.layout
        base = by_layout.get(replace(c.layout, schedule="1f1b", chunks_per_rank=1))
        if c.layout.schedule in faster and base is not None:
            faster[c.layout.schedule] += c.time["step"] < base
            twins[c.layout.schedule] += 1
    # measured: zb1p faster in 161 of 188, zbv in 135
    assert 2 * faster["zb1p"] > twins["zb1p"] and faster["zbv"] > 0, (faster, twins)


def test_every_layout_is_simulated_or_pruned_with_a_reason():
    spec, cluster = NAMED["megatron-39b"], PRESETS["dgx-a100-80gb"]
    feasible, pruned = plan(spec, cluster, 96, 192, top=3)
    space = sum(1 for _ in enumerate_layouts(spec, 96, 192))
    assert len(feasible) + sum(p.count for p in pruned) == space
    assert all(p.reason for p in pruned)
    reasons = " ".join(p.reason for p in pruned)
    for needle in ("does not divide the 64 heads", "would cross nodes", "per GPU, more than",
                   "lower bound"):
        assert needle in reasons


def test_the_search_variant_is_dataclasses_replace():
    """``search._variant`` (the layouts ``_expand`` builds positionally, faster than
    ``replace``) sets what it is given and keeps every other field: a field added to
    ``Layout`` and not passed there would make this fail."""
    from dataclasses import fields

    from shardwise.planner.search import _variant

    rep = Layout(dp=8, tp=4, pp=3, micro_batch_size=2, micro_batches=6, schedule="interleaved",
                 chunks_per_rank=2, zero=1, recompute="full", sp=True, partition="params",
                 selective=True, cp=2, ep=2, fp8=True, dp_replicate=2, cp_a2a=2)
    assert all(getattr(rep, f.name) != f.default for f in fields(Layout))  # none at default
    assert _variant(rep, True, False, False, 4) == replace(rep, recompute=True, sp=False,
                                                           selective=False, cp_a2a=4)
    assert _variant(rep, "full", True, True) == replace(rep, cp_a2a=1)


def test_the_1t_plan_answers_fast():
    """The issue's case: 1T parameters on 3,072 A100s, the whole space (the CLI's timing is
    in docs/benchmarks.md); here only that it finds a layout and simulates few."""
    import time

    t0 = time.process_time()
    feasible, _ = plan(NAMED["megatron-1t"], PRESETS["dgx-a100-80gb"], 3072, 3072)
    cpu = time.process_time() - t0
    assert 10 <= len(feasible) < 100
    assert feasible[0].memory["total"] <= 80 * 2**30
    assert cpu < 30, cpu  # about 2 s of CPU on the 2-core machine
    best = asdict(feasible[0].layout)
    assert best["tp"] * best["cp"] == 8  # the model-parallel ranks fill a node, no more


def _cli(capsys, *argv):
    from shardwise.cli.main import main

    assert main(["plan", *argv]) == 0
    return capsys.readouterr()


def test_table_columns_stay_aligned_with_long_names(capsys):
    import re

    out = _cli(capsys, "--model", "megatron-39b", "--cluster", "dgx-a100-80gb", "--gpus", "64",
               "--global-batch", "128", "--top", "30", "--pruned", "5").out.splitlines()
    head = next(i for i, line in enumerate(out) if line.lstrip().startswith("#"))
    rows = out[head:head + 31]
    names = [re.split(r"\s{2,}", r.strip())[1] for r in rows[1:]]
    assert max(map(len, names)) - min(map(len, names)) >= 10, names  # short and long names
    # every column ends where its header ends
    for word in ("static", "total", "step ms", "tokens/s", "opt"):
        end = rows[0].index(word) + len(word)
        for r in rows[1:]:
            assert r[end - 1] != " " and (end == len(r) or r[end] == " "), (word, r)
    pruned = out[out.index(next(x for x in out if x.startswith("pruned:"))) + 1:]
    assert len(pruned) == 5
    starts = {line.index(re.split(r"\s{2,}", line.strip())[2]) for line in pruned}
    assert len(starts) == 1, pruned  # the reasons start in one column


def test_json_output(capsys):
    import json

    got = _cli(capsys, "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16",
               "--global-batch", "64", "--top", "4", "--json")
    doc = json.loads(got.out)  # nothing but the document on stdout
    assert doc["model"]["name"] == "llama3-8b" and doc["model"]["kind"] == "llama"
    assert doc["gpus"] == 16 and doc["global_batch"] == 64 and doc["precision"] == "bf16"
    rows = doc["layouts"]
    assert [r["rank"] for r in rows] == [1, 2, 3, 4]
    steps = [r["step_s"] for r in rows]
    assert steps == sorted(steps)
    for r in rows:
        lay = r["layout"]
        assert lay["dp"] * lay["tp"] * lay["pp"] * lay["cp"] == 16
        assert r["memory_bytes"]["total"] <= doc["cluster"]["memory_limit_bytes"]
        assert sum(r["split_s"].values()) == pytest.approx(r["step_s"], rel=1e-9)
        assert r["tokens_per_s"] == pytest.approx(64 * 8192 / r["step_s"])
    assert doc["simulated"] >= 4
    assert all(p["count"] >= 1 and p["reason"] for p in doc["pruned"])


def test_progress_bar_only_when_slow(capsys, monkeypatch):
    """A bar on stderr once the search has taken a second, none for a quick one."""
    import time

    from shardwise.planner import search

    spec, cluster = NAMED["gpt2-350m"], PRESETS["dgx-a100-80gb"]
    plan(spec, cluster, 8, 64, micro_batches=[8], top=2, progress=True)
    assert capsys.readouterr().err == ""
    real = search.simulate

    def slow(*a, **k):
        time.sleep(0.4)
        return real(*a, **k)

    monkeypatch.setattr(search, "simulate", slow)
    plan(spec, cluster, 8, 64, micro_batches=[8], top=5, progress=True)
    assert "plan: simulating" in capsys.readouterr().err


def test_json_and_columns_carry_the_new_axes(capsys):
    """A mixture of experts on H100s: ep in the names, the layouts and the split (JSON), an
    ep column in the table, aligned; a long sequence: cp likewise."""
    import json
    import re

    # --ep 8: tp2 with sequence parallelism (searched with experts now) ranks first here,
    # the best ep8 layout within 2 % of it
    doc = json.loads(_cli(capsys, "--model", "mixtral-8x7b", "--seq", "4096", "--cluster",
                          "dgx-h100", "--gpus", "64", "--global-batch", "256", "--top", "5",
                          "--ep", "8", "--json").out)
    assert doc["model"]["n_experts"] == 8 and doc["model"]["top_k"] == 2
    rows = doc["layouts"]
    assert any(r["layout"]["ep"] > 1 for r in rows)
    for r in rows:
        lay = r["layout"]
        assert lay["dp"] * lay["tp"] * lay["pp"] * lay["cp"] == 64 and lay["dp"] % lay["ep"] == 0
        assert (f"ep{lay['ep']}" in r["label"]) == (lay["ep"] > 1)
        assert (r["split_s"]["ep"] > 0) == (lay["ep"] > 1)
        assert sum(r["split_s"].values()) == pytest.approx(r["step_s"], rel=1e-9)
    out = _cli(capsys, "--model", "llama3-8b", "--seq", "65536", "--cluster", "dgx-h100",
               "--gpus", "32", "--global-batch", "32", "--top", "8", "--fp8").out.splitlines()
    head = next(i for i, line in enumerate(out) if line.lstrip().startswith("#"))
    rows = out[head:head + 9]
    assert " cp " in rows[0] and " ep " not in rows[0] and "(fp8:" in out[head - 1]
    assert any(re.search(r" cp[0-9]+ ", r) for r in rows[1:])
    for word in ("total", "step ms", "comp", "cp", "opt"):
        end = rows[0].index(f" {word}") + 1 + len(word)
        for r in rows[1:]:
            assert r[end - 1] != " " and (end == len(r) or r[end] == " "), (word, r)


@pytest.mark.parametrize("argv,needle", [
    (["--model", "llama3-8b", "--cluster", "dgx-a100-80gb", "--fp8"], "has no FP8 tensor cores"),
    (["--model", "llama3-8b", "--cluster", "dgx-h100", "--ep", "2"], "has no experts"),
    (["--model", "llama3-8b", "--cluster", "dgx-h100", "--cp", "2,x"], "--cp 'x'"),
    (["--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--cp", "3"],
     "--cp 3: does not divide the 8 GPUs"),
    (["--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--gpus", "8", "--ep", "3"],
     "--ep 3: must divide the 8 GPUs and the 8 experts"),
    (["--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "8",
      "--fp8", "--emit-toml", "/nonexistent/never.toml"], "drop --fp8 to emit one"),
])
def test_new_axes_bad_input_is_one_line_exit_2(capsys, argv, needle):
    assert_one_line_exit_2(["plan", *argv], capsys, needle)



def test_forced_cp_for_a_model_with_dropout_is_one_line_exit_2(capsys, tmp_path):
    """``--cp 2`` for a model with dropout: the engine would refuse every such layout."""
    toml = tmp_path / "drop.toml"
    toml.write_text("[model]\nn_layer = 2\nn_head = 4\nn_embd = 64\nblock_size = 64\n"
                    "vocab_size = 256\ndropout = 0.1\n")
    assert_one_line_exit_2(["plan", "--model", str(toml), "--cluster", "dgx-h100", "--gpus", "8",
                            "--global-batch", "8", "--cp", "1,2"], capsys,
                           "--cp 2: drop has model.dropout = 0.1")


def test_bounded_search_with_blocking_sends_and_context_parallelism():
    """Megatron's kernels (sends charged to the sender, none in flight) and a long sequence
    (cp in the space): the bound still holds and the bounded search finds the same best."""
    from shardwise.planner.hardware import GEMM_SCALE, per_op

    cluster = per_op(FIXED_PRESETS["dgx-a100-80gb"], "megatron-2021", GEMM_SCALE)
    spec = NAMED["gpt3-13b"].with_seq(8192)
    space = {"micro_batches": [1, 2], "zero": (0, 1)}
    every, _ = plan(spec, cluster, 32, 64, exhaustive=True, **space)
    fast, _ = plan(spec, cluster, 32, 64, top=3, **space)
    assert any(c.layout.cp > 1 for c in every) and any(c.layout.pp > 1 for c in every)
    key = lambda c: (c.layout, c.time["step"])
    assert [key(c) for c in fast[:3]] == [key(c) for c in every[:3]]
    b = Bounds(spec, cluster, "bf16")
    for c in every:
        assert lower_bound(b, c.layout) <= c.time["step"] * (1 + 1e-9), c.layout


def test_the_cheap_bound_stays_below_the_lower_bound():
    """``Bounds.cheap`` (the search's first bound, from the whole model's seconds and the
    ranks' extras) never exceeds ``lower_bound`` on a sample of layouts of every kind
    (pp with v = 1, 2, 4, ZeRO 0-3, sp, recomputation full and selective, cp, both cuts,
    blocking sends with Megatron's kernels), and ``simulate.model_seconds`` is the sum of
    the chunks' forward + backward less their blocking sends (ZeRO-0, to rounding); also
    that ZeRO-3's chunk costs priced once per chunk shape equal those priced chunk by chunk."""
    from dataclasses import replace

    from shardwise.planner.hardware import GEMM_SCALE, per_op
    from shardwise.planner.memory import cut
    from shardwise.planner.search import prune_reason
    from shardwise.planner.simulate import _with_zero3, chunk_costs, model_seconds, zero3_seconds

    rng = random.Random(0)
    spec = NAMED["gpt3-13b"].with_seq(4096)
    for cluster in (PRESETS["dgx-a100-80gb"],
                    per_op(FIXED_PRESETS["dgx-a100-80gb"], "megatron-2021", GEMM_SCALE)):
        b = Bounds(spec, cluster, "bf16")
        every = [lay for lay, why in enumerate_layouts(spec, 64, 128, cp=[1, 2],
                                                       selective=(False, True))
                 if why is None and not prune_reason(spec, lay, cluster, False)]
        sample = rng.sample(every, 300)
        assert {lay.chunks_per_rank for lay in sample} == {1, 2, 4}
        assert {lay.zero for lay in sample} == {0, 1, 2, 3}
        for lay in sample:
            assert b.cheap(lay) <= lower_bound(b, lay), lay
            costs = chunk_costs(spec, replace(lay, zero=0), cluster, "bf16")
            whole = sum(c.forward + c.backward - c.pp for c in costs)
            assert model_seconds(spec, lay, cluster, "bf16") == pytest.approx(whole, rel=1e-12)
            if lay.zero == 3 and lay.dp * lay.cp > 1:
                part = cut(spec, lay.pp * lay.chunks_per_rank, lay.partition)
                by_chunk = [_with_zero3(c, zero3_seconds(spec, lay, cluster, "bf16",
                                                         list(part.layers(i))))
                            for i, c in enumerate(chunk_costs(
                                spec, replace(lay, zero=0), cluster, "bf16"))]
                assert chunk_costs(spec, lay, cluster, "bf16", memo={}) == by_chunk, lay


def test_selective_on_a_gpu_cluster_is_emitted_with_the_cuda_note(tmp_path, capsys):
    """``plan --selective --emit-toml`` on dgx-h100 (llama2-7b, 16 GPUs, batch 64, 70 GiB a
    GPU): the best layout is selective recomputation's (its plain twin, 73.5 GiB with
    compiled blocks, does not fit), written as
    ``parallel.recompute = "selective"`` in a config ``Config.from_dict`` accepts, with the
    comment and one stderr line saying train refuses it on CUDA today; without --selective
    no such layout is offered."""
    import tomllib

    from shardwise.base.config import Config
    from shardwise.cli.main import main

    out = tmp_path / "sel.toml"
    argv = ["plan", "--model", "llama2-7b", "--cluster", "dgx-h100", "--gpus", "16",
            "--global-batch", "64", "--top", "3", "--memory-gib", "70"]
    assert main([*argv, "--selective", "--emit-toml", str(out)]) == 0
    cap = capsys.readouterr()
    rows = [line for line in cap.out.splitlines() if line.lstrip().startswith("1  ")]
    assert "rc=sel" in rows[0]
    text = out.read_text()
    assert "rc=sel" in text.splitlines()[0] and "refuses it on CUDA" in text.splitlines()[1]
    cfg = Config.from_dict(tomllib.loads(text))
    assert cfg.parallel.recompute == "selective"
    assert [line for line in cap.err.splitlines() if line.startswith("note:")] == \
        [line for line in cap.err.splitlines() if "refuses it on CUDA" in line]
    assert "refuses it on CUDA" in cap.err
    assert main(argv) == 0
    assert "rc=sel" not in capsys.readouterr().out


def test_a_cut_by_params_that_cuts_as_layers_is_one_layout():
    """Cutting by parameters where that cuts the same chunks as by layers builds the same
    engine: the search lists it once (the first-named cut), and still counts every layout
    (simulated or pruned) as ``enumerate_layouts`` yields them. The 4 x 128 tied GPT of the
    local benchmark: into 2 chunks both cut (embedding + 2 blocks | 2 blocks + head), the
    engine's own ``partition_layers`` too; into 4 (pp 4, or pp 2 interleaved with v 2) they
    differ and both are searched."""
    import torch

    from shardwise.base.config import Config
    from shardwise.models import GPT, GPTConfig
    from shardwise.parallel.pipeline.partition import gpt_layers, partition_layers
    from shardwise.planner.specs import ModelSpec

    model = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "tie_weights": True}
    spec = replace(ModelSpec.from_section(Config.from_dict({"model": model}).model, "gpt"),
                   vocab_size=65)
    with torch.device("meta"):
        layers = [m for _, m in gpt_layers(GPT(GPTConfig(vocab_size=65, **model)))]
    assert (partition_layers(layers, 2, by="params").bounds
            == partition_layers(layers, 2, by="layers").bounds)
    assert (partition_layers(layers, 4, by="params").bounds
            != partition_layers(layers, 4, by="layers").bounds)
    feasible, pruned = plan(spec, PRESETS["dgx-h100"], 8, 16, top=3)
    space = [lay for lay, _ in enumerate_layouts(spec, 8, 16)]
    assert len(feasible) + sum(p.count for p in pruned) == len(space) == len(set(space))
    chunks = lambda lay: lay.pp * lay.chunks_per_rank  # noqa: E731
    cuts = {n: {lay.partition for lay in space if chunks(lay) == n} for n in (2, 4)}
    assert cuts == {2: {"layers"}, 4: {"layers", "params"}}, cuts
