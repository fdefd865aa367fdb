"""LoRA (issue 46): adapters on the targeted linears, the base frozen, in every layout.

The parity test spawns 8 ranks once and trains dp 2 x tp 2 x pp 2 under ZeRO-1 and then
ZeRO-3, then dp 2 x cp 2 x tp 2 with sequence parallelism under ZeRO-2 (adapters on every
column- and row-parallel linear of a tiny GPT), then a mixture-of-experts Llama at dp 2 x ep 2
x tp 2 x pp 2 under ZeRO-1 (adapters on the attention and the shared expert, the experts
frozen), each against one process: losses and every
adapter within 1e-5 relative, the base never touched, the memory prediction exact. Then the
PEFT round trip and the merged export, refusals at the door, and the planner's bytes."""

import pytest
import torch

from ddp_workers import tiny_config
from helpers import rel_err
from lora_workers import lora_worker, run_lora
from shardwise.base.config import Config, ConfigError
from shardwise.launch import spawn

RTOL = 1e-5
# every linear of the GPT's blocks: q, k, v, fc column-parallel, out_proj, mlp.proj row
TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc", "blocks.*.mlp.proj"]
# a Llama whose MLPs are mixtures of 4 experts (top 2) and a shared expert; adapters on the
# attention and on the shared expert (a dense SwiGLU), the stacked experts frozen
MOE = {"kind": "llama", "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16,
       "n_experts": 4, "top_k": 2, "moe_ffn_hidden": 32, "multiple_of": 16,
       "moe_shared_expert": True, "tie_weights": False}
MOE_TARGETS = ["[qkv]_proj", "o_proj", "*.shared_expert.*"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "zeta"]
    ids = torch.randint(0, len(words), (6000,), generator=g).tolist()
    path = tmp_path_factory.mktemp("lora") / "corpus.txt"
    path.write_text(" ".join(words[i] for i in ids), encoding="utf-8")
    return str(path)


def _cfg(corpus: str, out: str, parallel: dict | None = None, model: dict | None = None,
         **lora) -> dict:
    return tiny_config(corpus, out, training={"steps": 4, "global_batch_size": 8, "seed": 3},
                       optimizer={"lr": 1e-2, "warmup_steps": 1}, model=model or {},
                       parallel={"micro_batches": 2, **(parallel or {})},
                       lora={"rank": 4, "alpha": 8.0, "targets": TARGETS, **lora})


def _moe_cfg(corpus: str, out: str, parallel: dict | None = None) -> dict:
    return _cfg(corpus, out, parallel, MOE, targets=MOE_TARGETS)


def test_lora_dp2_tp2_pp2_zero1_zero3_cp2_sp_and_moe_ep2_match_one_process(corpus, tmp_path):
    ref = run_lora(_cfg(corpus, str(tmp_path / "ref"), {"dp": 1}))
    moe_ref = run_lora(_moe_cfg(corpus, str(tmp_path / "moe_ref"), {"dp": 1}))
    assert moe_ref["base_unchanged"] and moe_ref["base_grads"] == 0
    assert torch.tensor(moe_ref["losses"])[-1] < moe_ref["losses"][0]
    # q, k, v, o and the shared expert's gate, up, down in both blocks; no expert adapted
    assert len(moe_ref["params"]) == 2 * 2 * 7 and not any(
        ".experts." in n for n in moe_ref["params"])
    losses = torch.tensor(ref["losses"])
    assert losses[-1] < losses[0] and ref["base_unchanged"] and ref["base_grads"] == 0
    assert set(ref["params"]) == set(ref["piece_names"])  # the optimizer: adapters only
    assert all(n.endswith(("lora_A", "lora_B")) for n in ref["params"])
    assert len(ref["params"]) == 2 * 2 * len(TARGETS)  # 2 blocks, A and B each
    adapters = sum(t.numel() for t in ref["params"].values())
    # AdamW's fp32 moments (and no master: fp32) of the adapters only; all of it predicted
    assert ref["memory"]["optimizer"] == 8 * adapters == ref["predicted"]["optimizer"]
    assert ref["memory"]["grads"] == 4 * adapters and ref["memory"]["params"] > 5 * 4 * adapters
    grid = {"dp": 2, "tp": 2, "pp": 2}
    layouts = {"zero1": _cfg(corpus, str(tmp_path / "z1"), {**grid, "zero": 1}),
               "zero3": _cfg(corpus, str(tmp_path / "z3"), {**grid, "zero": 3}),
               # context parallelism, and sequence parallelism: replicated adapters' gradients
               # summed over tp since each rank saw a slice of the sequence
               "cp2_sp_zero2": _cfg(corpus, str(tmp_path / "cp"),
                                    {"dp": 2, "cp": 2, "tp": 2, "zero": 2,
                                     "sequence_parallel": True}),
               # a mixture of experts, the experts split over ep 2 (and by width over tp)
               # and frozen: ZeRO-1 must not broadcast one ep rank's experts to the other
               "moe_ep2_zero1": _moe_cfg(corpus, str(tmp_path / "moe"),
                                         {**grid, "ep": 2, "zero": 1})}
    results = spawn(lora_worker, 8, (list(layouts.values()),))
    for i, name in enumerate(layouts):
        ref_i = moe_ref if name.startswith("moe") else ref
        losses = torch.tensor(ref_i["losses"])
        seen = set()
        for rank, r in enumerate(results):
            got = r[i]
            assert got["base_unchanged"] and got["base_grads"] == 0 and got["frozen"], (name, rank)
            assert all(n.endswith(("lora_A", "lora_B")) for n in got["piece_names"])
            err = (torch.tensor(got["losses"]) - losses).abs() / losses.abs()
            assert (err <= RTOL).all(), (name, rank, got["losses"], ref_i["losses"])
            for n, t in got["params"].items():
                assert rel_err(t, ref_i["params"][n]) <= RTOL, (name, rank, n)
            seen |= set(got["params"])
            for k in ("params", "grads", "optimizer"):  # shardwise memory's prediction
                assert got["predicted"][k] == got["memory"][k], (name, rank, k)
        assert seen == set(ref_i["params"]), name  # the stages hold every adapter between them


def test_lora_in_bf16_keeps_the_frozen_base_in_bf16(corpus, tmp_path):
    got = run_lora(_cfg(corpus, str(tmp_path), {"dp": 1}, targets=["q_proj", "v_proj"])
                   | {"training": {**_cfg(corpus, str(tmp_path))["training"],
                                   "precision": "bf16"}})
    assert got["base_dtypes"] == ["torch.bfloat16"] and got["base_unchanged"]
    assert got["losses"][-1] < got["losses"][0]
    for k in ("params", "grads", "optimizer"):  # bf16 adapters with fp32 masters, predicted
        assert got["predicted"][k] == got["memory"][k], k


def test_a_lora_run_resumes_from_its_adapters_alone(corpus, tmp_path):
    """The checkpoint holds the adapters and their moments only (the base is rebuilt from
    the seed); stopped after 2 of 4 steps and resumed, the run equals the uninterrupted one."""
    from shardwise import checkpoint
    from layout_workers import resume_layout

    ref = run_lora(_cfg(corpus, str(tmp_path / "a"), {"dp": 1}))
    cfg = _cfg(corpus, str(tmp_path / "b"), {"dp": 1})
    got = resume_layout(cfg, 2)
    assert len(got["losses"]) >= 2 and got["losses"] == ref["losses"][-len(got["losses"]):]
    for n, t in got["params"].items():
        assert torch.equal(t, ref["params"][n]), n
    saved = checkpoint.read_tensors(checkpoint.complete_checkpoints(
        tmp_path / "b" / "checkpoints")[-1], "model.")
    assert saved and all(n.endswith(("lora_A", "lora_B")) for n in saved)


def test_lora_config_is_checked_at_the_door():
    with pytest.raises(ConfigError, match="lora.targets is empty"):
        Config.from_dict({"lora": {"rank": 2, "targets": []}})
    with pytest.raises(ConfigError, match="lora.rank with training.precision=fp8"):
        Config.from_dict({"lora": {"rank": 2}, "training": {"precision": "fp8"}})
    with pytest.raises(ConfigError, match="lora.rank"):
        Config.from_dict({"lora": {"rank": -1}})
    with pytest.raises(ConfigError, match="lora.rank with parallel.schedule=pipedream"):
        Config.from_dict({"lora": {"rank": 2}, "optimizer": {"grad_clip": 0},
                          "model": {"tie_weights": False},
                          "parallel": {"schedule": "pipedream", "pp": 2}})


def test_lora_targets_are_checked_at_the_door_in_one_line(corpus, tmp_path, capsys):
    from conftest import REPO
    from helpers import assert_one_line_exit_2

    argv = ["train", "--config", str(REPO / "configs" / "tiny.toml"), "--data", corpus, "--lora.rank", "2",
            "--training.out_dir", str(tmp_path / "run")]
    assert_one_line_exit_2(argv + ["--lora.targets", '["nothing_*"]'], capsys,
                           "lora.targets", "matches no linear layer")
    assert_one_line_exit_2(argv + ["--lora.targets", '["proj"]'], capsys,
                           "lora.targets", "head.proj is a vocab_head layer")
    moe = ["--model.kind", "llama", "--model.n_experts", "4", "--model.top_k", "2"]
    assert_one_line_exit_2(argv + moe + ["--lora.targets", '["up_proj"]'], capsys,
                           "lora.targets", "experts.up_proj is an expert weight")
    assert not (tmp_path / "run").exists()  # refused before any rank started


def test_lora_targets_that_match_nothing_or_the_head_are_refused(corpus, tmp_path):
    with pytest.raises(ValueError, match="matches no linear"):
        run_lora(_cfg(corpus, str(tmp_path / "a"), {"dp": 1}, targets=["nothing_*"]))
    with pytest.raises(ValueError, match="head.proj is a vocab_head layer"):
        run_lora(_cfg(corpus, str(tmp_path / "b"), {"dp": 1}, targets=["proj"]))
    # the stacked experts stay frozen: a pattern that names them (here by their last part,
    # as the dense MLPs' gate_proj) is refused, before any step
    with pytest.raises(ValueError, match="blocks.0.mlp.experts.gate_proj is an expert weight"):
        run_lora(_cfg(corpus, str(tmp_path / "c"), {"dp": 1}, MOE, targets=["gate_proj"]))


ALL_LLAMA = '["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]'


def _our_logits(run, idx: torch.Tensor) -> torch.Tensor:
    """The single-process model of the run's newest checkpoint (its base from model.init_from,
    its adapters from the checkpoint): logits of ``idx``."""
    from shardwise import checkpoint
    from shardwise.apps.lm.export import _vocab_size, find_checkpoint
    from shardwise.engine.model import build_local_model
    from shardwise.models.description import describe_section
    from shardwise.parallel.tensor_parallel.group import RankGroup

    path = find_checkpoint(run)
    meta = checkpoint.read_meta(path)
    cfg = Config.from_dict(meta["config"])
    d = describe_section(cfg.model, _vocab_size(meta["tokenizer"]))
    local = build_local_model(d, pp=1, pp_rank=0, chunk_ids=[0], n_chunks=1, tp=RankGroup(),
                              seed=cfg.training.seed, dropout_seed=0, device=torch.device("cpu"),
                              init_from=cfg.model.init_from.removeprefix("hf:"), lora=cfg.lora)
    saved = checkpoint.read_tensors(path, "model.")
    with torch.no_grad():
        for n, p in local.named_parameters():
            p.copy_(saved[f"model.{n}"])
        return local.chunks[0].eval()(idx)


def test_peft_loads_the_exported_adapters_and_the_merged_export_equals_them(
        corpus, tmp_path, capfd):
    """A random Llama saved by transformers, 3 LoRA steps from it at tp 2 on every linear of
    its blocks, then ``export --format peft``: ``PeftModel.from_pretrained`` on the base gives our
    model's logits; ``export --format hf --merge-lora``: the merged model gives them too."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from conftest import REPO
    from hf_models import VOCAB, save
    from shardwise.cli.main import main

    base = save("llama", tmp_path / "hf")
    run, adapter, merged = tmp_path / "run", tmp_path / "adapter", tmp_path / "merged"
    code = main(["train", "--config", str(REPO / "configs" / "finetune_hf.toml"),
                 "--data", corpus, "--model.init_from", f"hf:{base}", "--parallel.dp", "1",
                 "--parallel.tp", "2",  # the checkpoint holds the logical (whole) adapters
                 "--training.steps", "3", "--optimizer.lr", "1e-2",
                 "--optimizer.warmup_steps", "1", "--lora.rank", "4", "--lora.alpha", "8",
                 "--lora.targets", ALL_LLAMA, "--training.out_dir", str(run),
                 "--training.eval_batches", "1", "--training.sample_chars", "0",
                 "--training.progress", "false"])
    assert code == 0, capfd.readouterr().err[-3000:]
    assert main(["export", str(run), "--format", "peft", "--out", str(adapter)]) == 0
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json",
                                                         "adapter_model.safetensors"]
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = _our_logits(run, idx)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        plain = hf_base(idx).logits
        model = peft.PeftModel.from_pretrained(hf_base, str(adapter)).eval()
        theirs = model(idx).logits
    assert rel_err(plain, ours) > 1e-3  # the adapters trained: they change the logits
    assert rel_err(theirs, ours) <= 1e-5
    adapted = [n for n, _ in model.named_modules() if n.endswith(".lora_A")]
    assert len(adapted) == 2 * 7  # every linear of both blocks, nothing else

    assert main(["export", str(run), "--format", "hf", "--merge-lora", "--out", str(merged)]) == 0
    with torch.no_grad():
        merged_logits = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()(idx).logits
    assert rel_err(merged_logits, ours) <= 1e-5
    capfd.readouterr()
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "x")]) == 2
    err = capfd.readouterr().err.strip()
    assert "holds its adapters only" in err and len(err.splitlines()) == 1


def test_the_planner_counts_gradients_and_optimizer_state_of_the_adapters_only(tmp_path):
    """``shardwise plan``'s memory model with [lora]: a run's TOML (exact: the meta-device
    prediction the parity test holds equal to real ranks) and a named size (the per-layer
    counts plus the adapters of one block): the base costs its compute-dtype bytes only."""
    from dataclasses import replace

    from shardwise.planner.memory import adapter_params, static_bytes
    from shardwise.planner.specs import NAMED, load_model

    run = tmp_path / "run.toml"
    run.write_text('[model]\nkind = "llama"\nn_layer = 2\nn_head = 4\nn_embd = 64\n'
                   'vocab_size = 97\nblock_size = 32\n'
                   '[lora]\nrank = 4\ntargets = ["q_proj", "down_proj"]\n')
    spec = load_model(str(run))
    assert spec.lora == (4, ("q_proj", "down_proj"))
    full = static_bytes(replace(spec, lora=()), 2, 2, 2, 1, 1, "bf16")
    mine = static_bytes(spec, 2, 2, 2, 1, 1, "bf16")
    assert mine["grads"] < full["grads"] / 20 and mine["optimizer"] < full["optimizer"] / 20
    assert mine["params"] > full["params"]  # the base, and the adapters on top

    base = NAMED["gpt2-124m"]  # above the exact path's limit: the per-layer counts
    lora = replace(base, lora=(8, ("q_proj", "v_proj")))
    a = adapter_params(lora, 1)
    assert a == 2 * 8 * (768 + 768)  # q and v: A (8, 768) and B (768, 8) each, per block
    got = static_bytes(lora, 1, 1, 1, 1, 0, "bf16")
    plain = static_bytes(base, 1, 1, 1, 1, 0, "bf16")
    adapters = a * base.n_layer
    assert got["grads"] == 2 * adapters and got["optimizer"] == 12 * adapters
    assert got["params"] == plain["params"] + 2 * adapters


def test_the_planner_prices_a_lora_step_without_the_base_weight_gradients_and_sync():
    """The planner's step time for [lora]: each block's backward and the head's skip the
    frozen base's weight-gradient GEMMs (one forward of their linear GEMMs, the attention
    core's not among them), under the per-operation model and the fixed one; the dp sync
    moves the adapters' gradients only, and AdamW steps their masters only."""
    from dataclasses import replace

    from shardwise.planner.comm_price import dp_seconds
    from shardwise.planner.compute import block_ops, head_seconds, optimizer_seconds
    from shardwise.planner.costs import block_costs, model_seconds
    from shardwise.planner.hardware import FIXED_PRESETS, PRESETS
    from shardwise.planner.layout import Layout
    from shardwise.planner.memory import adapter_params, padded_vocab
    from shardwise.planner.specs import NAMED

    base = NAMED["gpt2-124m"]
    lora = replace(base, lora=(8, ("q_proj", "v_proj")))
    lay = Layout(4, 2, 1, 2, 4)
    for cluster in (PRESETS["dgx-h100"], next(iter(FIXED_PRESETS.values()))):
        blk, plain = block_costs(lora, lay, cluster, "bf16"), block_costs(base, lay, cluster,
                                                                          "bf16")
        assert plain.frozen_weight_grad == plain.frozen_head_grad == 0.0
        if cluster.ops is not None:  # the block's GEMMs but Q K^T and P V; the head's GEMM
            ops = block_ops(base, 2, 2, False, cluster.kernels, 2)
            gemm = cluster.ops.gemm
            assert blk.frozen_weight_grad == pytest.approx(
                sum(gemm(x) for i, x in enumerate(ops.gemms) if i not in (1, 2)))
            assert blk.frozen_head_grad == pytest.approx(gemm(
                2 * 2 * base.block_size * base.n_embd * padded_vocab(base.vocab_size, 2) / 2))
            assert blk.frozen_head_grad < head_seconds(base, 2, 2, cluster, 2)
        else:  # FLOPs at the rate: the block's less the attention core's
            assert 0 < blk.frozen_weight_grad < blk.block and 0 < blk.frozen_head_grad
        skipped = base.n_layer * blk.frozen_weight_grad + blk.frozen_head_grad
        assert model_seconds(base, lay, cluster, "bf16") - model_seconds(
            lora, lay, cluster, "bf16") == pytest.approx(skipped)
        layers = list(range(base.n_layer + 2))
        x = adapter_params(lora, 2) * base.n_layer * 2  # bf16 bytes of the adapters' grads
        link = cluster.link(lay.world)
        want = link.all_reduce(4, x) + link.all_reduce(4, 0)
        assert dp_seconds(lora, lay, cluster, "bf16", layers).after == pytest.approx(want)
        assert dp_seconds(base, lay, cluster, "bf16", layers).after > 20 * want
        # AdamW's memory traffic over the adapters' masters only
        share = max(1.0, lay.world / cluster.cores) if cluster.cores else 1.0
        assert optimizer_seconds(lora, lay, cluster, layers) == pytest.approx(
            40 * x / 2 / cluster.mem_bw * share + cluster.step_s)
