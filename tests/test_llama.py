"""The Llama (RMSNorm, RoPE, SwiGLU, GQA; ``model.kind = "llama"``) in every layout
against one process.

Two Llamas: ``gqa-tied`` (4 query heads sharing 2 key/value heads, the head tied to the
embedding, the SwiGLU width from Llama's rule) and ``mha-untied-qk`` (4 kv heads, untied,
vocabulary 75 so that tp = 2 pads it, and Qwen's attention options: Q/K/V biases, QK-norm,
a head_dim of 12 where n_embd / n_head is 8); and ``gemma3``, Gemma 3's shape in small
(zero-centred norms, scaled embedding, GeGLU, sandwich norms, QK-norm, its own score scale,
a window on layer 0 with its local rotary base, the global layer's linearly scaled; the
logits soft-capped), trained at dp2 x tp2 (+SP) x pp2. One process trains each for
``STEPS`` steps (the reference, itself checked against a plain ``torch.manual_seed(seed);
Llama(cfg)`` with AdamW); then one spawn of 8 ranks and one of 4 train every layout of
``LAYOUTS`` on the same global batches. Parity (fp32): every loss and every parameter
tensor of every rank (every dp replica, tp rank and stage, gathered whole) within ``RTOL``
relative of the reference (measured at most: losses 1.2e-7; parameters 4.8e-6, the plain MHA's
``blocks.1.mlp`` under tp = 2, Adam magnifying fp32 sums taken in another order;
with Qwen's options: parameters 2.6e-6, its ``blocks.1.self_attn.k_proj.bias``; the
Gemma 3 shape at dp2 x tp2 (+SP) x pp2: losses 1.1e-7, parameters 3.2e-6; ``doc-mask``, a
Llama with ``attention_mask = "block_causal"`` on the packed documents of conftest's ``packed``
(a window on layer 0 ANDed with the document mask), at dp2 x tp2 (+SP) x pp2 1F1B ZeRO-1:
losses 8.4e-8, parameters 4.4e-7; interleaved with full recomputation, 4 micro-batches:
6.3e-8, 3.9e-7).
``RESUMES``: a checkpoint saved at step ``STOP`` in one layout continues in another.
``SMOKES``: settings with no exact reference (PipeDream's stale weights, bf16) run and stay
finite; bf16 (fp32 masters) and fp16 (loss scaling) under ZB-H1 equal 1F1B's of the same
layout (``SPLIT_PAIRS``).
Then the size checks at the door and the issue's command line. Two spawns and one
command of 8 ranks: about a minute on 2 cores.
"""

import math

import pytest
import torch

from conftest import REPO
from ddp_workers import tiny_config
from helpers import assert_one_line_exit_2, rel_err, run_shardwise
from llama_workers import llama_worker, run_job
from shardwise.launch import spawn

STEPS, STOP = 5, 3
RTOL = 1e-5
# test_bf16_split_backward_equals_the_fused (measured: bf16 and fp16 equal bit for bit;
# dropping one micro-batch's W moves bf16's losses 8.8e-3, within SMOKE_RTOL, the parameters
# 0.2; a B that drops fp16's loss scale on the last chunk, fp16's losses 5.2e-3, also within)
BF16_PAIR_RTOL = 1e-6
_BASE = {"kind": "llama", "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16}
MODELS = {
    "gqa-tied": {**_BASE, "n_kv_heads": 2, "multiple_of": 16, "tie_weights": True},  # ffn 96
    "mha-untied-qk": {**_BASE, "n_kv_heads": 0, "ffn_hidden": 64, "tie_weights": False,
                      "vocab_size": 75,  # the corpus has 74 characters: 75 pads to 76 at tp 2
                      # Qwen's attention: Q/K/V biases (split over tp with their rows),
                      # q_norm / k_norm (replicated; each tp rank's gradient is its heads'
                      # part, summed over tp with or without SP), heads 12 wide, not 32 / 4
                      "qkv_bias": True, "qk_norm": True, "head_dim": 12},
    # Gemma 3's shape in small: zero-centred norms (QK-norm too), the embedding scaled by
    # sqrt(32), GeGLU, sandwich norms, the scores' own scale, a window of 6 on layer 0 with
    # its own rotary base, the global layer's base 1e6 scaled linearly by 8; the logits
    # soft-capped (Gemma 2's, element-wise on each tp rank's slice of the vocabulary)
    "gemma3": {**_BASE, "n_kv_heads": 2, "head_dim": 12, "qk_norm": True, "ffn_hidden": 64,
               "vocab_size": 75, "tie_weights": True, "norm_zero_centered": True,
               "scale_embedding": True, "mlp_activation": "gelu_tanh", "sandwich_norm": True,
               "query_pre_attn_scalar": 10.0, "sliding_window": 6,
               "layer_types": ["sliding_attention", "full_attention"], "rope_theta": 1e6,
               "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear",
                                                             "factor": 8.0},
               "final_logit_softcapping": 5.0},
    # packed documents (``model.attention_mask = "block_causal"``) on the ``packed`` data:
    # windows of 16 tokens with end-of-text separators at varied places; a window of 6 on
    # layer 0 ANDed with the document mask
    "doc-mask": {**_BASE, "n_kv_heads": 2, "multiple_of": 16, "tie_weights": False,
                 "attention_mask": "block_causal", "sliding_window": 6,
                 "layer_types": ["sliding_attention", "full_attention"]},
}
DATA = {"doc-mask": "packed"}  # model -> its data (default: the corpus)
DP2TP2PP2 = {"dp": 2, "tp": 2, "pp": 2, "micro_batches": 2}
# name -> (world size, model, parallel section, other sections)
LAYOUTS = {
    "2x2x2-1f1b-z1": (8, "gqa-tied", {**DP2TP2PP2, "zero": 1}, {}),
    "2x2x2-interleaved-z2": (8, "mha-untied-qk", {**DP2TP2PP2, "zero": 2, "schedule": "interleaved",
                                               "chunks_per_rank": 2}, {}),
    "2x2x2-gpipe-recompute": (8, "gqa-tied", {**DP2TP2PP2, "schedule": "gpipe",
                                              "recompute": True}, {}),
    "dp2xtp2-z3-sp": (4, "mha-untied-qk", {"dp": 2, "tp": 2, "zero": 3,
                                        "sequence_parallel": True}, {}),
    "dp2xtp2-z3-sp-gqa": (4, "gqa-tied", {"dp": 2, "tp": 2, "zero": 3,
                                          "sequence_parallel": True}, {}),
    "2x2x2-sp-z1-gemma3": (8, "gemma3", {**DP2TP2PP2, "zero": 1, "sequence_parallel": True},
                           {}),
    # document masks on every stage, each micro-batch its own: 1F1B with SP, and interleaved
    # with full recomputation (the backward reruns each chunk in its micro-batch's documents)
    "2x2x2-sp-1f1b-z1-doc": (8, "doc-mask", {**DP2TP2PP2, "zero": 1, "sequence_parallel": True},
                             {}),
    "2x2x2-interleaved-recompute-doc": (8, "doc-mask", {**DP2TP2PP2, "micro_batches": 4,
                                                        "schedule": "interleaved",
                                                        "chunks_per_rank": 2, "recompute": True},
                                        {}),
    # zero-bubble schedules (split backward): ZB-V with SP and ZeRO-1, the tied embedding and
    # head on rank 0 (one parameter); ZB-H1 with dp and ZeRO-1 (resumed from 1F1B below)
    "2x2x2-zbv-sp-z1": (8, "gqa-tied", {**DP2TP2PP2, "zero": 1, "schedule": "zbv",
                                        "chunks_per_rank": 2, "sequence_parallel": True}, {}),
    "dp2xpp2-zb1p-z1": (4, "gqa-tied", {"dp": 2, "tp": 1, "pp": 2, "zero": 1,
                                        "micro_batches": 2, "schedule": "zb1p"}, {}),
    # DualPipeV: ZB-V's V with fused and split backwards, dp and ZeRO-1
    "dp2xpp2-dualpipev-z1": (4, "gqa-tied", {"dp": 2, "tp": 1, "pp": 2, "zero": 1,
                                             "micro_batches": 4, "schedule": "dualpipev",
                                             "chunks_per_rank": 2}, {}),
    # 1F1B at dp2 x pp2 with ZeRO-2: DualPipeV's checkpoint resumed here (RESUMES)
    "dp2xpp2-1f1b-z2": (4, "gqa-tied", {"dp": 2, "tp": 1, "pp": 2, "zero": 2,
                                        "micro_batches": 2}, {}),
}
DP2PP2 = {"dp": 2, "tp": 1, "pp": 2, "zero": 1, "micro_batches": 2}
BF16 = {"training": {"precision": "bf16"}}
FP16 = {"training": {"precision": "fp16"}}  # dynamic loss scaling, from 65536
SMOKES = {  # PipeDream: no ZeRO, no clipping (no flush), no embedding tied across stages
    "2x2x2-pipedream": (8, "mha-untied-qk", {**DP2TP2PP2, "schedule": "pipedream"},
                        {"optimizer": {"grad_clip": 0.0}}),
    "2x2x2-bf16-z1": (8, "gqa-tied", {**DP2TP2PP2, "zero": 1},
                      {"training": {"precision": "bf16"}}),
    # bf16 compute, fp32 masters: ZB-H1 against 1F1B of the same layout (SPLIT_PAIRS)
    "dp2xpp2-1f1b-bf16-z1": (4, "gqa-tied", DP2PP2, BF16),
    "dp2xpp2-zb1p-bf16-z1": (4, "gqa-tied", {**DP2PP2, "schedule": "zb1p"}, BF16),
    # fp16 compute under loss scaling, fp32 masters: the same pair (SPLIT_PAIRS)
    "dp2xpp2-1f1b-fp16-z1": (4, "gqa-tied", DP2PP2, FP16),
    "dp2xpp2-zb1p-fp16-z1": (4, "gqa-tied", {**DP2PP2, "schedule": "zb1p"}, FP16),
}
# (split backward, fused backward): the same low-precision ops, the weight gradients later
SPLIT_PAIRS = [("dp2xpp2-zb1p-bf16-z1", "dp2xpp2-1f1b-bf16-z1"),
               ("dp2xpp2-zb1p-fp16-z1", "dp2xpp2-1f1b-fp16-z1")]
# how far each smoke's losses may stray from the fp32 reference's (relative); measured:
# PipeDream 4.1e-2 (stale weights: each micro-batch's forward sees other versions), bf16 6e-5
SMOKE_RTOL = {"2x2x2-pipedream": 0.1, "2x2x2-bf16-z1": 0.01, "dp2xpp2-1f1b-bf16-z1": 0.01,
              "dp2xpp2-zb1p-bf16-z1": 0.01, "dp2xpp2-1f1b-fp16-z1": 0.01,
              "dp2xpp2-zb1p-fp16-z1": 0.01}
# name -> (the run that saved at step STOP: a layout or "ref:<model>", the layout resuming)
RESUMES = {
    "dp1->2x2x2-1f1b-z1": ("ref:gqa-tied", "2x2x2-1f1b-z1"),
    "2x2x2-interleaved-z2->dp2xtp2-z3-sp": ("2x2x2-interleaved-z2", "dp2xtp2-z3-sp"),
    "2x2x2-1f1b-z1->dp2xpp2-zb1p-z1": ("2x2x2-1f1b-z1", "dp2xpp2-zb1p-z1"),
    "2x2x2-zbv-sp-z1->dp2xtp2-z3-sp-gqa": ("2x2x2-zbv-sp-z1", "dp2xtp2-z3-sp-gqa"),
    "2x2x2-1f1b-z1->dp2xpp2-dualpipev-z1": ("2x2x2-1f1b-z1", "dp2xpp2-dualpipev-z1"),
    # out of DualPipeV's V (embedding and head on pipeline rank 0) into 1F1B's line
    "dp2xpp2-dualpipev-z1->dp2xpp2-1f1b-z2": ("dp2xpp2-dualpipev-z1", "dp2xpp2-1f1b-z2"),
}


def _cfg(sources, out, model: str, parallel: dict | None = None, sections: dict | None = None):
    sections = dict(sections or {})
    training = {"steps": STEPS, "global_batch_size": 8, **sections.pop("training", {})}
    return tiny_config(str(sources[DATA.get(model, "corpus")]), str(out), model=MODELS[model],
                       parallel=parallel or {}, training=training, **sections)


@pytest.fixture(scope="module")
def sources(corpus, packed):
    """The data of each model (``DATA``): the Shakespeare text or the packed documents."""
    return {"corpus": corpus, "packed": packed}


@pytest.fixture(scope="module")
def references(sources, tmp_path_factory):
    """One process (no torch.distributed), each model; ``gqa-tied`` saves at ``STOP``."""
    root = tmp_path_factory.mktemp("llama-ref")
    return {m: run_job({"kind": "run", "cfg": _cfg(sources, root / m, m),
                        "save_at": STOP if f"ref:{m}" in {a for a, _ in RESUMES.values()}
                        else None})
            for m in MODELS}


@pytest.fixture(scope="module")
def results(sources, tmp_path_factory, references):
    """name -> every rank's report, for ``LAYOUTS``, ``SMOKES`` and ``RESUMES``: the spawn of
    8 first (it resumes the reference's checkpoint and saves one), then the spawn of 4."""
    root = tmp_path_factory.mktemp("llama-layouts")
    saved = {f"ref:{m}": r.get("saved") for m, r in references.items()}
    savers = {a for a, _ in RESUMES.values()}
    out = {}
    for ws in (8, 4):
        jobs = []
        for name, (w, model, parallel, sections) in {**LAYOUTS, **SMOKES}.items():
            if w == ws:
                jobs.append((name, {"kind": "run", "save_at": STOP if name in savers else None,
                                    "cfg": _cfg(sources, root / name, model, parallel, sections)}))
        for name, (a, b) in RESUMES.items():
            w, model, parallel, sections = LAYOUTS[b]
            if w == ws:  # a saver of this spawn runs first: its checkpoint directory
                assert saved.get(a) or a in dict(jobs), f"{a} must save before {name} resumes"
                where = ({"path": saved[a]} if saved.get(a) else
                         {"from_dir": str(root / a / "checkpoints")})
                jobs.append((name, {"kind": "resume", **where,
                                    "cfg": _cfg(sources, root / name, model, parallel, sections)}))
        ranks = spawn(llama_worker, ws, ([j for _, j in jobs],))
        for i, (name, _) in enumerate(jobs):
            out[name] = [r[i] for r in ranks]
            if name in savers:
                saved[name] = out[name][0]["saved"]
    return out


def test_reference_is_the_plain_llama(references, sources):
    """The one-process reference is ``torch.manual_seed(seed); Llama(cfg)`` trained by
    torch's AdamW (decay on matrices, warm-up/cosine, clip 1.0) on the sampler's batches
    (under ``block_causal`` with each batch's document ids set, as the engine sets them)."""
    import contextlib

    from shardwise.apps.lm.text import split_corpus
    from shardwise.base.config import Config
    from shardwise.data import DistributedBatchSampler
    from shardwise.models import sequence
    from shardwise.models.llama import Llama, from_section
    from shardwise.training.schedule import warmup_cosine

    for m, ref in references.items():
        cfg = Config.from_dict(_cfg(sources, "unused", m))
        tok, train_tokens, _ = split_corpus(cfg)
        t, o = cfg.training, cfg.optimizer
        torch.manual_seed(t.seed)
        model = Llama(from_section(cfg.model, tok.vocab_size))
        params = list(model.parameters())
        opt = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), foreach=False)
        sched = warmup_cosine(opt, o, t.steps)
        sampler = DistributedBatchSampler(train_tokens, cfg.model.block_size,
                                          t.global_batch_size, 0, 1, seed=t.seed)
        losses = []
        separators = 0
        for _ in range(t.steps):
            x, y = sampler.next_batch()
            within = contextlib.nullcontext()
            if cfg.model.attention_mask == "block_causal":
                separators += int((x == tok.eos_id).sum())
                within = sequence.use(sequence.SequenceShard(
                    documents=sequence.document_ids(x, tok.eos_id)))
            with within:
                _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        assert losses[-1] < losses[0], (m, losses)
        if cfg.model.attention_mask == "block_causal":  # documents really are packed
            assert separators >= t.steps * t.global_batch_size // 2, (m, separators)
        assert ref["kind"] == "llama" and len(ref["losses"]) == STEPS
        assert ((torch.tensor(ref["losses"]) - torch.tensor(losses)).abs()
                <= RTOL * torch.tensor(losses)).all(), (m, ref["losses"], losses)
        mine = dict(model.named_parameters())  # the tied head is the embedding, listed once
        assert set(ref["params"]) == set(mine), m
        for n, p in mine.items():
            assert rel_err(ref["params"][n], p.detach()) <= RTOL, (m, n)


def _check_ranks(name: str, ranks: list[dict], ref: dict, pp: int) -> None:
    """Every rank's losses and parameters (its stages', whole) against the reference; the
    stages of each dp replica together hold the whole model, each only its part."""
    ref_losses = torch.tensor(ref["losses"])
    by_replica: dict[int, set] = {}
    for r in ranks:
        losses = torch.tensor(r["losses"])
        assert r["kind"] == "llama" and len(losses) == STEPS, (name, r["coords"])
        assert ((losses - ref_losses).abs() <= RTOL * ref_losses.abs()).all(), (
            name, r["coords"], r["losses"], ref["losses"])
        for n, t in r["params"].items():
            assert t.shape == ref["params"][n].shape, (name, r["coords"], n)
            err = rel_err(t, ref["params"][n])
            assert err <= RTOL, (name, r["coords"], n, err)
        if "tied_head" in r:  # the last stage's copy of the tied matrix stays the embedding
            err = rel_err(r["tied_head"], ref["params"]["embed.tok.weight"])
            assert err <= RTOL, (name, r["coords"], "tied head", err)
        if pp > 1:
            assert len(r["params"]) < len(ref["params"]), (name, r["coords"])
        by_replica.setdefault(r["coords"]["dp"], set()).update(r["params"])
    assert len(by_replica) == 2  # every layout here has two dp replicas
    for dp, names in by_replica.items():
        assert names == set(ref["params"]), (name, dp, set(ref["params"]) ^ names)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(results, references, name):
    ws, model, parallel, _ = LAYOUTS[name]
    ref = references[model]
    assert ref["losses"][-1] < ref["losses"][0]  # it trained: equality is no tautology
    ranks = results[name]
    assert len(ranks) == ws
    _check_ranks(name, ranks, ref, parallel.get("pp", 1))
    tied = [r for r in ranks if "tied_head" in r]
    if MODELS[model]["tie_weights"] and parallel.get("pp", 1) > 1:  # the copy exists, checked
        # a V (zbv, dualpipev) puts the embedding and the head on pipeline rank 0: one
        # parameter, no copy
        v_shaped = parallel.get("schedule") in ("zbv", "dualpipev")
        assert len(tied) == (0 if v_shaped else ws // 2), name


def test_gqa_key_value_heads_split_over_tp(results):
    """GQA at tp = 2: 4 query heads and 2 kv heads, each tp rank holding one kv head (the
    one its two query heads share); the parity above is of these shapes."""
    checked = 0
    for name, (_, model, parallel, _) in LAYOUTS.items():
        if model != "gqa-tied" or parallel["tp"] == 1:  # tp = 1: nothing split
            continue
        assert parallel["tp"] == 2
        for r in results[name]:
            assert r["model"]["n_kv_heads"] == 2 and r["model"]["n_head"] == 4
            for n, shape in r["local_shapes"].items():  # this rank's piece, not the gathered
                if n.endswith(("k_proj.weight", "v_proj.weight")):
                    assert shape == (8, 32), (name, n, shape)  # one kv head of 8 per tp rank
                    assert r["params"][n].shape == (2 * 8, 32), (name, n)  # gathered: both
                    checked += 1
    assert checked > 0


@pytest.mark.parametrize("name", list(RESUMES))
def test_checkpoint_resumes_in_another_layout(results, references, name):
    """Saved at step ``STOP`` in layout A, loaded by a fresh trainer in layout B (other
    dp/tp/pp, ZeRO stage, schedule): the history carries over, and the continued losses and
    the final parameters of every rank match the uninterrupted run within ``RTOL``."""
    a, b = RESUMES[name]
    ws, model, parallel, _ = LAYOUTS[b]
    ref = references[model]
    saver = references[a[4:]] if a.startswith("ref:") else results[a][0]
    uninterrupted = results[b][0]["losses"]
    ranks = results[name]
    assert len(ranks) == ws
    for r in ranks:
        assert r["resumed_at"] == STOP and r["losses"][:STOP] == saver["losses"][:STOP], r["coords"]
        cont, want = torch.tensor(r["losses"][STOP:]), torch.tensor(uninterrupted[STOP:])
        assert len(cont) == STEPS - STOP and ((cont - want).abs() <= RTOL * want).all(), (
            name, r["coords"], r["losses"], uninterrupted)
    _check_ranks(name, ranks, ref, parallel.get("pp", 1))


@pytest.mark.parametrize("name", list(SMOKES))
def test_other_settings_run_and_stay_finite(results, references, name):
    """PipeDream (stale weights by design) and bf16 have no exact one-process reference:
    every rank's losses finite, falling, and near the fp32 reference's."""
    ref = torch.tensor(references[SMOKES[name][1]]["losses"])
    for r in results[name]:
        losses = torch.tensor(r["losses"])
        assert r["finite"] and len(losses) == STEPS, (name, r["coords"], r["losses"])
        assert losses[-1] < losses[0], (name, r["coords"], r["losses"])
        assert ((losses - ref).abs() <= SMOKE_RTOL[name] * ref).all(), (
            name, r["coords"], losses, ref)
        assert not torch.equal(losses, ref)  # really another computation
        assert all(math.isfinite(float(t.abs().max())) for t in r["params"].values())


@pytest.mark.parametrize("split,fused", SPLIT_PAIRS)
def test_bf16_split_backward_equals_the_fused(results, split, fused):
    """bf16 compute with fp32 masters, and fp16 under loss scaling: the split backward (B,
    then W later, both on the scaled loss) computes the fused one's gradients, so every loss
    and parameter of every rank agrees within ``BF16_PAIR_RTOL`` (the low precision itself
    moves them ~1e-3, SMOKE_RTOL's check)."""
    for a, b in zip(results[split], results[fused]):
        assert a["coords"] == b["coords"]
        la, lb = torch.tensor(a["losses"]), torch.tensor(b["losses"])
        assert ((la - lb).abs() <= BF16_PAIR_RTOL * lb.abs()).all(), (a["coords"], la, lb)
        assert set(a["params"]) == set(b["params"])
        for n, t in a["params"].items():
            err = rel_err(t, b["params"][n])
            assert err <= BF16_PAIR_RTOL, (a["coords"], n, err)


def test_memory_prediction_equals_measured_bytes(results):
    """``engine.memory.predict_rank`` of the Llama (meta device, no run) against the bytes
    every rank of every run holds: parameters, gradients, optimizer state, exactly."""
    from shardwise.engine.memory import predict_rank
    from shardwise.models.llama import LlamaConfig

    checked = 0
    for name, (ws, _, p, sections) in {**LAYOUTS, **SMOKES}.items():
        for r in results[name]:
            c = r["coords"]
            pred = predict_rank(
                LlamaConfig(**r["model"]), dp=p["dp"], pp=p.get("pp", 1), tp=p["tp"],
                dp_rank=c["dp"], pp_rank=c["pp"], tp_rank=c["tp"],
                chunks_per_rank=p.get("chunks_per_rank", 1), zero=p.get("zero", 0),
                precision=sections.get("training", {}).get("precision", "fp32"),
                sequence_parallel=p.get("sequence_parallel", False),
                schedule=p.get("schedule", "1f1b"))
            for k in ("params", "grads", "optimizer"):
                assert pred[k] == r["memory"][k], (name, c, k, pred, r["memory"])
            checked += 1
    assert checked == sum(w for w, *_ in {**LAYOUTS, **SMOKES}.values())


def test_tp_not_dividing_kv_heads_is_one_line(corpus, tmp_path, capsys):
    """n_kv_heads = 1 at tp = 2: the engine's build (before any tensor exists) and
    ``shardwise train`` (exit 2, before any rank starts) say so in one line naming
    model.n_kv_heads."""
    from shardwise.engine.model import build_local_model
    from shardwise.models.llama import LlamaConfig
    from shardwise.parallel.tensor_parallel.group import RankGroup

    cfg = LlamaConfig(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_kv_heads=1, n_embd=32)
    with pytest.raises(ValueError, match=r"model\.n_kv_heads .*=1 is not divisible by tp=2") as e:
        build_local_model(cfg, pp=1, pp_rank=0, chunk_ids=[0], n_chunks=1,
                          tp=RankGroup(size=2, rank=1), seed=0, dropout_seed=0,
                          device=torch.device("cpu"))
    assert "\n" not in str(e.value)
    out = tmp_path / "run"
    assert_one_line_exit_2(["train", "--config", str(REPO / "configs" / "tiny.toml"), "--data",
                            str(corpus), "--model.kind", "llama", "--model.n_kv_heads", "1",
                            "--parallel.dp", "1", "--parallel.tp", "2", "--training.out_dir",
                            str(out)], capsys,
                           "model.n_kv_heads (key/value heads)=1 is not divisible by parallel.tp=2")
    assert not out.exists()  # refused at the door


def test_pipedream_with_a_tied_llama_across_stages_is_refused():
    """PipeDream's stages step on their own clocks: the two copies of a tied embedding on
    the first and last stage cannot be summed per step (it deadlocked); the engine says so
    before building anything (the config refuses it too, see test_pp_trainer.py)."""
    from shardwise.base.topology import Topology
    from shardwise.engine import Engine, EngineConfig
    from shardwise.models.llama import LlamaConfig

    settings = EngineConfig(
        seq_len=16, parallel={"schedule": "pipedream", "micro_batches": 2},
        optimizer={"grad_clip": 0.0}, training={"global_batch_size": 8})
    cfg = LlamaConfig(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_kv_heads=2,
                      n_embd=32, tie_weights=True)
    with pytest.raises(ValueError, match="pipedream with model.tie_weights=true and parallel.pp=2"):
        Engine(cfg, Topology.build(1, 2, 1, rank=0, world_size=2), settings)


@pytest.mark.slow  # the README runs this command (tests/test_readme.py)
def test_cli_llama_dp2_tp2_pp2_zero1(tmp_path):
    """The issue's command: a Llama in dp2 x tp2 x pp2 with ZeRO-1 for 20 steps, exit 0."""
    from shardwise.training.metrics import read_metrics

    out = tmp_path / "run"
    cmd = ["train", "--model.kind", "llama", "--config", "configs/tiny.toml", "--parallel.dp",
           "2", "--parallel.tp", "2", "--parallel.pp", "2", "--parallel.zero", "1",
           "--training.steps", "20", "--training.out_dir", str(out)]
    proc = run_shardwise(*cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shardwise: llama " in proc.stdout and "done: 20 steps" in proc.stdout, proc.stdout
    assert "dp=2 x pp=2 (1f1b, m=1) x tp=2, ZeRO-1" in proc.stdout
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], losses
