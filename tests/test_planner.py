"""The planner's memory model against real ranks, its pruning reasons, its CLI, its TOML.

- closed forms (used for named sizes) equal ``engine.memory.predict_rank`` (no processes);
- one spawn per world size (4, 8) trains each layout one step (about 40 s each here): the planner's static bytes
  (parameters, gradients, optimizer states) equal the largest rank's measured bytes exactly,
  the closed form equals every rank's parameter count, and the predicted peak activation
  bytes are within 10% of the executor's meter (bytes autograd saved for backward,
  storages counted once, weights excluded, recompute inputs included);
- pruning reasons; one-line errors with exit 2; the emitted TOML trains.
"""

import tomllib

import pytest

from ddp_workers import tiny_config
from helpers import assert_one_line_exit_2, assert_proc_one_line_exit_2, run_shardwise
from planner_workers import measure_worker
from shardwise.launch import spawn
from shardwise.planner.memory import (
    activation_bytes,
    rank_params,
    stage_layers,
    static_bytes,
    zero_bytes,
)
from shardwise.planner.simulate import Layout
from shardwise.planner.specs import NAMED, ModelSpec

MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 64, "block_size": 32}
BATCH = 16
ACT_RTOL = 0.10

LAYOUTS = {
    4: [dict(dp=2, tp=2), dict(dp=2, tp=2, zero=1, sequence_parallel=True),
        dict(dp=2, pp=2, micro_batches=4, zero=2), dict(dp=4, zero=3),
        dict(dp=1, tp=2, pp=2, micro_batches=4, schedule="interleaved", chunks_per_rank=2,
             recompute=True),
        dict(dp=1, pp=4, micro_batches=4, schedule="gpipe"),
        dict(dp=2, pp=2, micro_batches=4, zero=3)],
    8: [dict(dp=2, tp=2, pp=2, micro_batches=4, zero=1), dict(dp=2, pp=4, micro_batches=4),
        dict(dp=1, tp=2, pp=4, micro_batches=8, sequence_parallel=True),
        dict(dp=8, zero=2), dict(dp=4, tp=2, zero=3, recompute=True)],
}


def _spec(gpt: dict) -> ModelSpec:
    return ModelSpec("t", gpt["n_layer"], gpt["n_embd"], gpt["n_head"], gpt["vocab_size"],
                     gpt["block_size"], gpt["tie_weights"], gpt["bias"])


def test_closed_form_equals_predict_rank():
    """The closed forms the planner uses for large models count the same parameters as the
    meta-device build, rank by rank (tp shards, vocabulary padding, tied copies, chunks)."""
    from shardwise.engine.memory import predict_rank
    from shardwise.models import GPTConfig

    checked = 0
    for L, h, a, V, tp, bias, tie in [(4, 64, 4, 67, 2, True, True), (5, 64, 4, 65, 4, True, False),
                                      (3, 64, 8, 65, 2, False, True)]:
        spec = ModelSpec("x", L, h, a, V, 32, tie, bias)
        cfg = GPTConfig(V, 32, L, a, h, bias=bias, tie_weights=tie)
        for pp, v, by in ((1, 1, "layers"), (2, 1, "layers"), (3, 1, "layers"), (2, 2, "layers"),
                          (3, 1, "params"), (2, 2, "params")):
            for pr, layers in enumerate(stage_layers(spec, pp, v, by)):
                P = rank_params(spec, layers, tp, pp)
                for z in (0, 1, 2, 3):
                    d = predict_rank(cfg, dp=2, pp=pp, tp=tp, pp_rank=pr, chunks_per_rank=v,
                                     zero=z, precision="bf16", bucket_mb=0.01, partition_by=by)
                    c = zero_bytes(P, 2, z, "bf16")
                    if z == 0:
                        assert {k: d[k] for k in c} == c, (L, tp, pp, v, pr)
                    else:  # equal up to the padding to a multiple of dp, stated per bucket
                        for k in ("params", "grads", "optimizer"):
                            assert abs(d[k] - c[k]) <= 16 * 2 * 64, (k, d[k], c[k])
                    checked += 1
    assert checked > 40


def test_gathered_units_are_the_engines_units():
    """``gathered_bytes`` against the units ``ZeroStage3`` makes of each chunk as the
    engine builds it (on meta): a layer's own parameters, a weight tied across stages a
    unit of its own, one tied within the chunk the root; each padded to dp. The peak is the
    root and the two neighbouring layers with the most bytes (one gathered, the next
    prefetched), at pp 1 (the tied matrix the root) and pp 2, 3 (a unit on both ends); with
    v = 2 chunks per rank (interleaved) each chunk is a ``ZeroStage3`` of its own, run one
    at a time, so the peak is the largest chunk's."""
    import torch

    from shardwise.engine.model import build_local_model
    from shardwise.models import GPTConfig
    from shardwise.parallel.tensor_parallel.group import RankGroup
    from shardwise.planner.memory import gathered_bytes

    checked = 0
    for L, h, a, V, tie, bias in [(4, 64, 4, 67, True, True), (5, 64, 4, 65, False, True),
                                  (3, 64, 8, 65, True, False)]:
        spec = ModelSpec("x", L, h, a, V, 32, tie, bias)
        cfg = GPTConfig(V, 32, L, a, h, bias=bias, tie_weights=tie)
        for dp, tp, pp, v in ((2, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (3, 2, 2, 1),
                              (2, 1, 3, 1), (2, 1, 2, 2), (3, 2, 2, 2), (2, 1, 3, 2)):
            if pp * v > L + 2:
                continue
            want = 0
            for pr in range(pp):
                with torch.device("meta"):
                    local = build_local_model(
                        cfg, pp=pp, pp_rank=pr, chunk_ids=[pr + i * pp for i in range(v)],
                        n_chunks=pp * v, tp=RankGroup(size=tp, rank=0), seed=0,
                        dropout_seed=0, device=torch.device("meta"))
                tied = {id(q) for n, q in local.named_parameters() if n in local.tied}
                for chunk in local.chunks.values():
                    owners: dict = {}
                    for layer in chunk.layers:
                        for q in layer.parameters():
                            owners[id(q)] = owners.get(id(q), 0) + 1
                    pad = lambda x: -(-x // dp) * dp  # noqa: E731
                    root = pad(sum({id(q): q.numel() for layer in chunk.layers
                                    for q in layer.parameters() if owners[id(q)] > 1}.values()))
                    per = []
                    for layer in chunk.layers:
                        own = [q for q in layer.parameters() if owners[id(q)] == 1]
                        per.append(sum(pad(q.numel()) for q in own if id(q) in tied)
                                   + pad(sum(q.numel() for q in own if id(q) not in tied)))
                    pair = max([x + y for x, y in zip(per, per[1:])] or per)
                    want = max(want, 2 * (root + pair))
            assert gathered_bytes(spec, dp, tp, pp, 3, "bf16", v=v) == want, (L, tie, dp, tp, pp, v)
            assert gathered_bytes(spec, dp, tp, pp, 2, "bf16", v=v) == 0
            checked += v > 1
    assert checked >= 5


def test_gathered_units_under_ep_are_the_engines_units():
    """With ep > 1 (``ZeroStage3(expert_group=)``) each block is two units, its dense
    parameters (padded to dp) and this rank's E / ep experts (padded to dp / ep), in that
    order; walking ``ZeroStage3``'s hooks over the units the engine builds (on meta, a Llama
    MoE: forward gathers a unit and prefetches the next, backward prefetches the one before,
    a layer's units freed after it) gives the peak ``gathered_bytes`` predicts, at pp 1-3
    and tp 1, 2 (a root is held throughout: none here, the Llama is untied)."""
    import torch

    from shardwise.engine.model import build_local_model
    from shardwise.parallel.experts import is_expert
    from shardwise.parallel.tensor_parallel.group import RankGroup
    from shardwise.planner.memory import gathered_bytes

    spec = ModelSpec("moe", 4, 64, 4, 67, 32, tie_weights=False, bias=False, n_kv_heads=2,
                     ffn_hidden=96, family="llama", n_experts=4, top_k=2)
    for dp, tp, pp, ep in ((2, 1, 1, 2), (4, 1, 2, 2), (4, 2, 1, 2), (4, 1, 3, 4),
                           (8, 2, 2, 2)):
        want = 0
        for pr in range(pp):
            with torch.device("meta"):
                local = build_local_model(
                    spec.model(), pp=pp, pp_rank=pr, chunk_ids=[pr], n_chunks=pp,
                    tp=RankGroup(size=tp, rank=0), seed=0, dropout_seed=0,
                    device=torch.device("meta"), ep=RankGroup(size=ep, rank=0, axis="ep"))
            (chunk,) = local.chunks.values()
            layers = []  # per layer its units' padded elements: dense, then experts
            for layer in chunk.layers:
                ps = list(layer.parameters())
                d = sum(q.numel() for q in ps if not is_expert(q))
                x = sum(q.numel() for q in ps if is_expert(q))
                layers.append([-(-d // dp) * dp] + ([-(-x // (dp // ep)) * (dp // ep)] if x else []))
            flat = [(li, u) for li, us in enumerate(layers) for u in range(len(us))]
            size = {(li, u): layers[li][u] for li, u in flat}
            peak = 0
            for step, order in ((+1, flat), (-1, flat[::-1])):
                held: set = set()
                for li in (range(len(layers)) if step > 0 else range(len(layers) - 1, -1, -1)):
                    for u in range(len(layers[li])):  # each unit's hook, in the unit order
                        held.add((li, u))
                        j = flat.index((li, u)) + step
                        if 0 <= j < len(flat):
                            held.add(flat[j])  # the prefetch
                    peak = max(peak, sum(size[k] for k in held))
                    held -= {(li, u) for u in range(len(layers[li]))}
            want = max(want, 2 * peak)
        assert gathered_bytes(spec, dp, tp, pp, 3, "bf16", ep=ep) == want, (dp, tp, pp, ep)
        # ep = 1: the experts inside their block's one unit, padded to dp with it
        assert gathered_bytes(spec, dp, tp, pp, 3, "bf16") != want


def test_named_sizes_match_their_papers():
    """Parameter counts of the named sizes as their papers state them."""
    assert round(NAMED["gpt2-124m"].params / 1e6) == 124
    assert round(NAMED["gpt3-175b"].params / 1e9) == 175
    assert round(NAMED["megatron-1t"].params / 1e9, 1) == 1008.0  # Narayanan et al. Table 1
    assert round(NAMED["megatron-146b"].params / 1e9, 1) == 145.6
    assert round(NAMED["phi3-mini"].params / 1e9, 1) == 3.8  # Abdin et al. 2024 (Phi-3)


@pytest.fixture(scope="module", params=[4, 8], ids=["ws4", "ws8"])
def measured(request, corpus, tmp_path_factory):
    ws = request.param
    out = str(tmp_path_factory.mktemp(f"plan{ws}"))
    configs = [tiny_config(str(corpus), out, model=MODEL, parallel=p,
                           training={"steps": 1, "global_batch_size": BATCH})
               for p in LAYOUTS[ws]]
    results = spawn(measure_worker, ws, (configs,))
    return [(configs[i], [r[i] for r in results]) for i in range(len(configs))]


def test_memory_predictions_equal_measured(measured):
    for cfg, ranks in measured:
        p, prec = cfg["parallel"], cfg["training"]["precision"]
        spec = _spec(ranks[0]["gpt"])
        pred = static_bytes(spec, p["dp"], p["tp"], p["pp"], p["chunks_per_rank"], p["zero"],
                            prec, p["sequence_parallel"], p["bucket_mb"])
        worst = max(ranks, key=lambda r: r["memory"]["total"])["memory"]
        for k in ("params", "grads", "optimizer", "total"):
            assert pred[k] == worst[k], (p, k, pred, worst)
        if p["zero"] == 0:  # the closed form, rank by rank
            per_stage = stage_layers(spec, p["pp"], p["chunks_per_rank"])
            for r in ranks:
                P = rank_params(spec, per_stage[r["coords"]["pp"]], p["tp"], p["pp"])
                assert 4 * P == r["memory"]["params"], (p, r["coords"])


def test_activation_predictions_within_10_percent(measured):
    """Every layout but ZeRO-3's: there the meter packs each gathered weight at full size
    before ZeRO-3 frees its storage after forward, so it reads weights as activations."""
    checked = 0
    for cfg, ranks in measured:
        p = cfg["parallel"]
        if p["zero"] == 3:
            continue
        checked += 1
        spec = _spec(ranks[0]["gpt"])
        mb = BATCH // p["dp"] // p["micro_batches"]
        pred = activation_bytes(spec, mb=mb, tp=p["tp"], pp=p["pp"],
                                micro_batches=p["micro_batches"],
                                v=p["chunks_per_rank"], schedule=p["schedule"],
                                sp=p["sequence_parallel"], recompute=p["recompute"],
                                precision="fp32")
        got = max(r["activations"] for r in ranks)
        assert got > 0
        assert abs(pred - got) <= ACT_RTOL * got, (p, pred, got, pred / got)
    assert checked >= 4


def test_pruning_reasons():
    from shardwise.planner.hardware import PRESETS
    from shardwise.planner.search import plan, prune_reason

    spec = ModelSpec("t", 4, 96, 6, 65, 32)
    a100 = PRESETS["dgx-a100-40gb"]
    assert "does not divide the 6 heads" in prune_reason(spec, Layout(1, 4, 1, 1, 1), a100, False)
    wide = ModelSpec("w", 4, 128, 16, 65, 32)
    assert "cross nodes" in prune_reason(wide, Layout(1, 16, 1, 1, 1), a100, False)
    assert prune_reason(wide, Layout(1, 16, 1, 1, 1), a100, True) is None
    assert prune_reason(spec, Layout(2, 1, 2, 1, 2, zero=3), a100, False) is None
    assert prune_reason(spec, Layout(2, 1, 2, 1, 2, "interleaved", 2, zero=3), a100, False) is None
    assert "more than the 6 layers" in prune_reason(spec, Layout(1, 1, 4, 1, 4, "interleaved", 2),
                                                    a100, False)
    assert "multiple of parallel.pp" in prune_reason(spec, Layout(1, 1, 2, 1, 3, "interleaved", 2),
                                                     a100, False)
    assert prune_reason(spec, Layout(2, 2, 2, 1, 4), a100, False) is None
    # memory: GPT-3 175B on 8 A100s fits nowhere; every layout pruned says how much it needs
    feasible, pruned = plan(NAMED["gpt3-175b"], a100, 8, 8, simulate_top=5)
    assert not feasible and all(p.need is None or p.need > 40 * 2**30 for p in pruned)


def _exit_code(argv) -> int:
    from shardwise.cli.main import main

    try:
        return main(argv)
    except SystemExit as e:  # argparse's own errors
        return e.code


@pytest.mark.parametrize("args,needle", [
    (["--model", "gpt2-124m", "--cluster", "dgx-z100"], "--cluster 'dgx-z100': unknown preset"),
    (["--model", "gpt3-175b", "--cluster", "dgx-a100-40gb", "--gpus", "8", "--global-batch", "8"],
     "fits no layout of 8 GPUs with 38 GiB each: the smallest needs"),
    (["--model", "gpt2-124m", "--cluster", "dgx-h100", "--gpus", "nan"], "--gpus 'nan'"),
    (["--model", "gpt2-124m", "--cluster", "dgx-h100", "--global-batch", "1e400"], "finite"),
    (["--model", "gpt2-124m", "--cluster", "dgx-h100", "--seq", "abc"], "expected a number"),
    (["--model", "no-such-model"], "neither a named size"),
])
def test_bad_input_is_one_line_exit_2(args, needle, capsys):
    """In this process (``shardwise.cli.main``; argparse's own exits caught): each fresh
    interpreter cost seconds. The entry point's exit code: the first case below, and
    test_cli.py's ``test_entry_point_exit_code_for_bad_input``."""
    assert_one_line_exit_2(["plan", *args], capsys, needle, main=_exit_code)


def test_entry_point_exit_code_for_bad_plan_input():
    assert_proc_one_line_exit_2(run_shardwise("plan", "--model", "gpt2-124m", "--cluster",
                                              "dgx-z100", cwd=None), "unknown preset")


def test_cnn_is_routed_to_its_chooser_with_its_own_options(capsys):
    from shardwise.cli.main import main

    assert main(["plan", "--model", "cnn", "--batch", "64", "--ranks", "4"]) == 0
    out = capsys.readouterr().out
    assert "batch 64, 4 ranks" in out and "compare: dp" in out
    assert_one_line_exit_2(["plan", "--model=cnn", "--plan", "column,dp,dp,dp,dp"], capsys,
                           "conv1=column", main=_exit_code)


def test_plan_ranks_a100_layouts():
    """A GPT-2 on one DGX A100: ranked by predicted time, memory within the GPU, time split
    adding up to the step."""
    from shardwise.planner.hardware import PRESETS
    from shardwise.planner.search import plan

    feasible, pruned = plan(NAMED["gpt2-350m"], PRESETS["dgx-a100-80gb"], 8, 64,
                            micro_batches=[1, 2, 4, 8])
    steps = [c.time["step"] for c in feasible]
    assert steps == sorted(steps) and pruned
    for c in feasible:
        assert c.memory["total"] <= 80 * 2**30
        parts = sum(c.time[k] for k in ("compute", "tp", "cp", "ep", "pp", "bubble", "dp",
                                        "optimizer"))
        assert parts == pytest.approx(c.time["step"], rel=1e-9)


# the selective case plans one rank and one sequence, so the micro-batch cannot shrink and
# memory alone decides: of the rank's 0.573 MiB the plain layout needs 0.593 MiB, full
# recomputation 0.596, selective 0.558 (weights, gradients and Adam 0.439 + activations).
# With room for several layouts the best is chosen by the times measured on the machine at
# hand, and CI's machine once chose another (ZeRO-2 over selective at dp = 2).
@pytest.mark.parametrize("extra", [
    # plain: also the README's plan -> train (tests/test_readme.py)
    pytest.param(["--gpus", "2", "--global-batch", "8"], marks=pytest.mark.slow),
    pytest.param(["--gpus", "1", "--global-batch", "1", "--selective", "--memory-gib",
                  "0.00056", "--pruned", "5"], marks=pytest.mark.slow),
    # full recomputation per block: 0.095 MiB of activations, 0.54 MiB in all
    ["--gpus", "1", "--global-batch", "1", "--recompute-full", "--memory-gib", "0.00054"]],
    ids=["plain", "selective", "full"])
def test_emitted_toml_trains(corpus, tmp_path, extra):
    """``shardwise plan --emit-toml`` writes a config that ``shardwise train`` runs as is,
    in a run directory of its own (``best`` beside the model's ``out_dir``, issue 41); with
    ``--selective`` and memory that only selective recomputation's layout fits (see above),
    that layout is written as ``parallel.recompute = "selective"`` with the CUDA note, and
    trains; so with ``--recompute-full``, ``parallel.recompute = "full"``."""
    model = tmp_path / "model.toml"
    model.write_text(f'[model]\nn_layer = 2\nn_head = 4\nn_embd = 32\nblock_size = 32\n\n'
                     f'[data]\npath = "{corpus}"\n\n[training]\nsteps = 2\neval_every = 0\n'
                     f'sample_chars = 0\nprogress = false\nout_dir = "{tmp_path / "run"}"\n\n'
                     '[checkpoint]\nat_end = false\n')
    out = tmp_path / "best.toml"
    r = run_shardwise("plan", "--model", str(model), "--emit-toml", str(out), *extra, cwd=None)
    assert r.returncode == 0, r.stderr
    assert "best layout written" in r.stdout and out.is_file()
    text = out.read_text()
    if "--selective" in extra:
        assert text.startswith("# written by shardwise plan: dp1 tp1 pp1 mb1 m1 z0 rc=sel\n")
        assert "z0  needs 0.000579 GiB per GPU" in r.stdout  # plain pruned for memory
        assert 'recompute = "selective"' in text and "refuses it on CUDA" in text
        assert "note:" not in r.stderr  # local: no GPU cluster to warn about
    elif "--recompute-full" in extra:  # only per-block recomputation fits
        assert text.startswith("# written by shardwise plan: dp1 tp1 pp1 mb1 m1 z0 rc=blk\n")
        assert 'recompute = "full"' in text
    else:
        assert 'recompute = "none"' in text
    assert f'out_dir = "{tmp_path / "best"}"' in text  # its own run, beside the model's
    assert "compile" not in text  # local prices eager blocks
    t = run_shardwise("train", "--config", str(out), cwd=None)
    assert t.returncode == 0, t.stderr
    assert "done: 2 steps" in t.stdout and f"outputs in {tmp_path / 'best'}" in t.stdout


def test_emitted_toml_has_a_run_directory_of_its_own(tmp_path):
    """``--emit-toml PATH`` writes ``training.out_dir = runs/<PATH's stem>``, beside the model
    TOML's own ``out_dir`` and never it, and no ``checkpoint.dir`` (the checkpoints follow
    out_dir): the emitted layout never resumes the model's run (issue 41, defect 2)."""
    from shardwise.base.config import Config
    from shardwise.cli.plan import emit_toml

    src = tmp_path / "tiny.toml"
    src.write_text('[model]\nn_layer = 2\nn_head = 4\nn_embd = 32\nblock_size = 32\n'
                   '[training]\nout_dir = "runs/tiny"\n'
                   '[checkpoint]\ndir = "/shared/ck"\nevery = 3\n')
    lay, spec = Layout(2, 1, 1, 1, 1, "1f1b"), NAMED["gpt2-124m"]
    cfg = Config.load(emit_toml(str(tmp_path / "best.toml"), str(src), spec, lay, 8, "fp32"))
    ck = cfg.checkpoint
    assert (cfg.training.out_dir, ck.dir, ck.every) == ("runs/best", None, 3)
    named = emit_toml(str(tmp_path / "b7.toml"), "gpt2-124m", spec, lay, 8, "fp32")
    assert Config.load(named).training.out_dir == "runs/b7"  # not the default runs/shakespeare


def test_emitted_zero3_pipeline_is_a_config_the_engine_accepts(tmp_path, capsys):
    """A ZeRO-3 x pp layout the search may now propose: ``--emit-toml``'s writer gives a
    config ``Config.from_dict`` accepts (ZeRO-3, one chunk per rank), and ``shardwise
    memory`` prices its ranks (``predict_rank``) rather than refusing them."""
    import tomllib

    from shardwise.base.config import Config
    from shardwise.cli.memory import main
    from shardwise.cli.plan import emit_toml
    from shardwise.engine.memory import predict_rank

    spec = NAMED["gpt2-124m"]
    lay = Layout(2, 1, 2, 2, 4, "1f1b", zero=3)
    path = emit_toml(str(tmp_path / "z3pp.toml"), "gpt2-124m", spec, lay, 16, "bf16")
    cfg = Config.from_dict(tomllib.loads(path.read_text()))
    assert (cfg.parallel.zero, cfg.parallel.pp, cfg.parallel.dp) == (3, 2, 2)
    assert cfg.parallel.chunks_per_rank == 1 and cfg.parallel.micro_batches == 4
    assert main(["--config", str(path), "--dp", "2", "--pp", "2", "--stages", "3"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["3", "0"], ["3", "1"]]  # zero, pp (no tp column at tp 1)
    d = spec.model()
    for z, pr, *vals in rows:
        want = predict_rank(d, dp=2, pp=2, pp_rank=int(pr), zero=3, precision="bf16")
        assert float(vals[-1]) == pytest.approx(want["total"] / 2**20, abs=6e-3)


def test_memory_cli_shares_the_model_and_names_its_unit(capsys):
    """``shardwise memory`` prints the planner's bytes, in the decimal unit its header
    names: the ZeRO paper's 7.5B example at dp 64 (120 / 31.4 / 16.6 / 1.88 GB), in the
    paper's decimal GB, which the header says."""
    from shardwise.cli.memory import main
    from shardwise.planner.memory import zero_bytes

    assert main(["--params", "7.5e9", "--dp", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "bytes per rank in GB (1 GB = 1e+09 bytes: decimal, as the ZeRO paper's table)" \
        in out[0]
    totals = [float(line.split()[-1]) for line in out[2:]]
    assert totals == [120.0, 31.41, 16.64, 1.88]
    assert totals == [round(zero_bytes(7.5e9, 64, s, "bf16")["total"] / 1e9, 2) for s in range(4)]


def _hf_config(path, cls_name: str, **fields):
    """Write ``path/config.json`` of a ``transformers`` config class (no weights: the
    planner reads config.json alone)."""
    import transformers

    cfg = getattr(transformers, cls_name)(**fields)
    cfg.architectures = [cls_name.replace("Config", "ForCausalLM")]
    path.mkdir()
    cfg.to_json_file(str(path / "config.json"))
    return path


def test_a_hugging_face_checkpoint_is_planned_from_its_config_json(tmp_path, capsys):
    """``--model hf:DIR`` plans the checkpoint's model (config.json read as ``shardwise
    train`` reads it, no weights): Llama-3-8B's and Mixtral-8x7B's config.json give the named
    sizes' parameters and the same ranked plan; a train config with ``model.init_from`` is
    planned (and ``shardwise memory``'d) as its checkpoint's model, not its [model] defaults;
    ``--emit-toml`` writes
    ``init_from`` and the planned sequence; a sequence beyond the checkpoint's context and a
    missing directory are one line, exit 2."""
    from shardwise.cli.main import main
    from shardwise.planner.specs import load_model

    llama = _hf_config(tmp_path / "llama", "LlamaConfig", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, max_position_embeddings=8192,
                       rope_theta=500000.0, tie_word_embeddings=False)
    mixtral = _hf_config(tmp_path / "mixtral", "MixtralConfig", vocab_size=32000,
                         hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=32768, rope_theta=1e6, num_local_experts=8,
                         num_experts_per_tok=2, tie_word_embeddings=False)
    for path, name in ((llama, "llama3-8b"), (mixtral, "mixtral-8x7b")):
        spec, named = load_model(f"hf:{path}", 4096), NAMED[name].with_seq(4096)
        assert spec.params == named.params, name
        assert (spec.family, spec.n_experts, spec.block_size) == (named.family, named.n_experts,
                                                                   4096)
    argv = ["--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "32", "--top", "3"]
    tables = []
    for model in (f"hf:{llama}", "llama3-8b"):
        assert main(["plan", "--model", model, "--seq", "4096", *argv]) == 0
        tables.append(capsys.readouterr().out.splitlines()[1:])
    assert tables[0] == tables[1] and len(tables[0]) == 6
    run_toml = tmp_path / "finetune.toml"
    run_toml.write_text(f'[model]\ninit_from = "hf:{llama}"\n\n[training]\nsteps = 2\n')
    assert load_model(str(run_toml), 4096).params == NAMED["llama3-8b"].params
    from shardwise.cli.memory import main as memory_main

    capsys.readouterr()
    assert memory_main(["--config", str(run_toml), "--dp", "8", "--stages", "1"]) == 0
    assert capsys.readouterr().out.startswith("llama 8030.26M parameters, 32 layers x 4096")
    out = tmp_path / "best.toml"
    assert main(["plan", "--model", f"hf:{llama}", "--seq", "2048", *argv,
                 "--emit-toml", str(out)]) == 0
    capsys.readouterr()
    written = tomllib.loads(out.read_text())
    assert written["model"] == {"init_from": f"hf:{llama}", "block_size": 2048}
    assert written["training"]["compile"] is True  # dgx-h100 priced compiled blocks
    assert_one_line_exit_2(["plan", "--model", f"hf:{llama}", "--seq", "9000", *argv], capsys,
                           "--seq 9000: longer than the checkpoint's 8192 tokens",
                           main=_exit_code)
    assert_one_line_exit_2(["plan", "--model", f"hf:{tmp_path / 'none'}", *argv], capsys,
                           "no such directory", main=_exit_code)


def test_a_bad_emit_toml_path_is_one_line_exit_2_before_the_search(tmp_path, capsys,
                                                                   monkeypatch):
    """``--emit-toml`` and ``--timeline`` are checked before the search (a directory, a
    file where its folder should be), and a full disk at the rename leaves the old file:
    one line naming the flag, exit 2, no traceback."""
    from shardwise.base import files
    from shardwise.planner import search

    blocker = tmp_path / "afile"
    blocker.write_text("mine")
    argv = ["plan", "--model", "gpt2-124m", "--cluster", "dgx-h100", "--gpus", "8",
            "--global-batch", "8"]
    searched = []
    real_plan = search.plan
    monkeypatch.setattr(search, "plan", lambda *a, **k: searched.append(1) or real_plan(*a, **k))
    for flag in ("--emit-toml", "--timeline"):
        assert_one_line_exit_2(argv + [flag, str(tmp_path)], capsys,
                               f"{flag} {tmp_path}: is a directory")
        assert_one_line_exit_2(argv + [flag, str(blocker / "best.toml")], capsys,
                               f"{flag} {blocker / 'best.toml'}: cannot create its folder")
    assert not searched
    out = tmp_path / "best.toml"
    out.write_text("# the user's own\n")

    def full(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(files.os, "replace", full)
    assert_one_line_exit_2(argv + ["--emit-toml", str(out)], capsys,
                           f"--emit-toml {out}: No space left on device")
    assert out.read_text() == "# the user's own\n" and blocker.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "best.toml"]
