"""Llama presets of the planner: published sizes, parameter counts, sharding, the CLI;
``shardwise plan`` and ``shardwise memory`` on a config of any model.kind (gpt, llama, a
kind registered here): specs made from the model's description, memory counted on its own
layers, Llama train configs emitted."""

from dataclasses import dataclass, replace

import pytest
import torch
from torch import nn

from helpers import assert_one_line_exit_2, run_shardwise
from shardwise.cli.main import main
from shardwise.engine.memory import predict_rank
from shardwise.models import GPTConfig, describe, register_model
from shardwise.models.description import ModelDescription
from shardwise.models.llama import Llama, LlamaConfig
from shardwise.planner.hardware import PRESETS
from shardwise.planner.memory import rank_params, stage_layers, static_bytes
from shardwise.planner.search import plan, prune_reason
from shardwise.planner.simulate import Layout, block_flops
from shardwise.planner.specs import NAMED, ModelSpec, load_model

# published totals: TinyLlama's model card, Llama 2's, Llama 3's, Phi-3-mini-4k's and
# Phi-4's released checkpoints (3.82B and 14.7B: transformers' Phi3ForCausalLM of these
# sizes counts 3,821,079,552 and 14,659,507,200; the Phi-4 report says "14B")
PUBLISHED = {"tinyllama-1.1b": 1.100e9, "llama2-7b": 6.738e9, "llama2-13b": 13.016e9,
             "llama2-70b": 68.977e9, "llama3-8b": 8.030e9, "llama3-70b": 70.554e9,
             "llama3-405b": 405.853e9, "phi3-mini": 3.821e9, "phi4": 14.660e9}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_params_match_published_and_the_model(name):
    spec = NAMED[name]
    assert abs(spec.params / PUBLISHED[name] - 1) < 0.005, spec.params
    cfg = LlamaConfig(spec.vocab_size, spec.block_size, spec.n_layer, spec.n_head,
                      spec.n_kv_heads, spec.n_embd, spec.ffn_hidden, tie_weights=spec.tie_weights)
    with torch.device("meta"):  # the real module, no memory
        model = Llama(cfg)
    assert model.num_parameters() == spec.params
    assert rank_params(spec, list(range(spec.n_layer + 2)), 1, 1) == spec.params


# Gemma's released totals (arXiv:2408.00118 Table 1 and arXiv:2503.19786 Table 1 list
# embedding and non-embedding parameters; these are the checkpoints' own totals)
GEMMA_PUBLISHED = {"gemma2-2b": 2_614_341_888, "gemma2-9b": 9_241_705_984,
                   "gemma2-27b": 27_227_128_320,
                   "gemma3-1b": 999_885_952, "gemma3-12b": 11_766_034_176,
                   "gemma3-27b": 27_009_346_304}


def test_gemma_presets_count_what_transformers_builds():
    """Each named Gemma (its released config.json's sizes, ``specs._GEMMA_SIZES``) counts
    the parameters of ``transformers``' Gemma2ForCausalLM / Gemma3ForCausalLM built from the
    config.json shardwise's export writes for it (on the meta device), and the released
    total; its FLOPs count the attention width H D of its head_dim (256 x 8 = 2048 for
    gemma2-2b, not h = 2304) and each layer's window (every other layer a query sees 4096
    keys of 8192, where the engine's two chunks of 4096 queries score 4096 and 8191 keys,
    written out: ``planner.attention``); Gemma 2's soft-capped scores rule out cp > 1, as
    the engine does; the model table emitted for it is the model."""
    transformers = pytest.importorskip("transformers")
    from shardwise.models.description import describe_section
    from shardwise.models.hf import arch_for
    from shardwise.planner.simulate import attention_gemm_flops
    from shardwise.planner.specs import gemma_config

    for name, total in GEMMA_PUBLISHED.items():
        spec, cfg = NAMED[name], gemma_config(name)
        arch = arch_for(cfg)
        assert arch.model_type == ("gemma2" if name.startswith("gemma2") else "gemma3_text")
        config = transformers.AutoConfig.for_model(**arch.config_json(cfg, None))
        with torch.device("meta"):
            theirs = transformers.AutoModelForCausalLM.from_config(config)
        assert spec.params == theirs.num_parameters() == total, name
    spec = NAMED["gemma2-2b"]
    assert spec.attn_width == 8 * 256 and spec.attn_keys == (4096 + 8192) / 2
    chunked = (4096 * 4096 + 4096 * 8191) / 8192  # a windowed layer's keys a query
    assert attention_gemm_flops(spec, 1) == 4 * 8192 * (chunked + 8192) / 2 * 2048
    from shardwise.planner.search import cp_a2a_choices, cp_reason

    # soft-capped: context parallelism by the all-to-all alone (the ring's kernels have no cap)
    assert cp_reason(spec, 2) is None and cp_a2a_choices(spec, 2, 1) == [2]
    assert cp_reason(NAMED["gemma3-27b"], 2) is None
    for name in NAMED:  # plan --emit-toml's [model] table trains this model (every named
        # size with a config of its own: the Gemmas and the DeepSeeks' latent attention)
        spec = NAMED[name]
        if spec.description is not None:
            assert (describe_section(spec.section(), spec.vocab_size).config
                    == spec.description.config), name
    assert NAMED["gemma2-2b"].description.config == gemma_config("gemma2-2b")



def _saved_bytes(block: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps from ``block(x)`` for backward."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(kept.values())


def test_written_out_scores_are_priced_as_autograd_keeps_them():
    """A model whose attention writes its scores out says so in its description (Gemma 2's
    soft cap: 2, the math path: 1, SDPA: 0; the GPT's math path: 1), and the planner counts
    what autograd keeps of them per head, query and key (``written_score_bytes``: 4 / 6 on
    the math path in fp32 / bf16, 8 / 8 soft-capped), measured on a Llama block; a Gemma 2's
    activations and memory-bound time grow by exactly those scores, at cp = 1 only."""
    from shardwise.models.gpt import describe as describe_gpt
    from shardwise.planner.memory import activation_bytes, mask_bytes, written_score_bytes
    from shardwise.planner.simulate import block_ops

    base = LlamaConfig(vocab_size=64, block_size=64, n_layer=1, n_head=4, n_kv_heads=2,
                       n_embd=64, head_dim=32, ffn_hidden=128)
    cases = {0: base, 1: replace(base, attention="math"),
             2: replace(base, attn_logit_softcapping=50.0)}
    assert describe_gpt(GPTConfig(vocab_size=64, attention="math")).written_scores == 1
    assert describe_gpt(GPTConfig(vocab_size=64)).written_scores == 0
    for dtype in (torch.float32, torch.bfloat16):
        e, kept = torch.finfo(dtype).bits // 8, {}
        for n, cfg in cases.items():
            assert describe(cfg).written_scores == n
            torch.manual_seed(0)
            block = Llama(cfg).to(dtype).blocks[0]
            kept[n] = _saved_bytes(block, torch.randn(2, 64, 64, dtype=dtype))
        for n in (1, 2):  # per score element of (B, H, T, T), beside a shared (T, T) mask
            per_score = (kept[n] - kept[0]) / (2 * 4 * 64 * 64)
            assert per_score == pytest.approx(written_score_bytes(n, e), abs=0.1), (dtype, n)
    spec = NAMED["gemma2-9b"]
    fused = replace(spec, written_scores=0)
    assert spec.written_scores == 2 and NAMED["gemma3-12b"].written_scores == 0
    s, heads = spec.block_size, spec.n_head // 8  # tp = 8
    kw = dict(mb=1, tp=8, pp=1, micro_batches=1, precision="bf16")
    grown = activation_bytes(spec, **kw) - activation_bytes(fused, **kw)
    # less the masks' difference (bool bands and triangle written out, bf16 additive bands
    # for SDPA: ``test_attention_masks.py``)
    grown -= sum(mask_bytes(spec, 1, "bf16")) - sum(mask_bytes(fused, 1, "bf16"))
    # every layer's scores, 8 bytes each: s x s, or on every other layer (a window of
    # 4096) the engine's two chunks of 4096 queries against 4096 and 8191 keys
    keys = (s + (4096 + 8191) / 2) / 2
    assert grown == pytest.approx(spec.n_layer * heads * s * keys * 8, rel=1e-12)
    assert activation_bytes(replace(spec, block_size=s), cp=2, **kw) == \
        activation_bytes(replace(fused, block_size=s), cp=2, **kw)  # the ring: none written
    moved = (sum(block_ops(spec, 1, 8, True, "shardwise", 2).moves)
             - sum(block_ops(fused, 1, 8, True, "shardwise", 2).moves))
    assert moved == 2 * heads * s * keys * (2 + 2 + 4 + 2)  # Q K^T, tanh, softmax, cast


def test_sandwich_norms_are_priced_as_autograd_keeps_them():
    """Gemma's two more RMSNorms a block (``sandwich_norm``) keep their input and an fp32
    copy each, as measured on a Llama block (fp32 and bf16); the planner adds exactly that
    to a block's activations (whole under tp, split under SP) and two norms' reads and
    writes to its memory-bound time."""
    from shardwise.planner.memory import shardwise_model
    from shardwise.planner.simulate import block_ops

    base = LlamaConfig(vocab_size=64, block_size=64, n_layer=1, n_head=4, n_kv_heads=2,
                       n_embd=64, head_dim=32, ffn_hidden=128)
    B, T, h = 2, 64, 64
    for dtype in (torch.float32, torch.bfloat16):
        e, kept, models = torch.finfo(dtype).bits // 8, {}, {}
        for sandwich in (False, True):
            cfg = replace(base, sandwich_norm=sandwich)
            torch.manual_seed(0)
            kept[sandwich] = _saved_bytes(Llama(cfg).to(dtype).blocks[0],
                                          torch.randn(B, T, h, dtype=dtype))
            spec = ModelSpec.from_description(describe(cfg))
            assert spec.sandwich_norm == sandwich
            models[sandwich] = shardwise_model("fp32" if e == 4 else "bf16", spec)
        grown = models[True].replicated - models[False].replicated  # bytes a token and h
        assert grown == 2 * (e + 4)
        # the measured growth, beside the norms' (B, T, 1) fp32 statistics
        assert (kept[True] - kept[False]) / (B * T * h) == pytest.approx(grown, abs=0.2)
    gemma = NAMED["gemma2-9b"]
    plain = replace(gemma, sandwich_norm=False)
    assert gemma.sandwich_norm
    ops, fewer = (block_ops(x, 1, 8, True, "shardwise", 2) for x in (gemma, plain))
    norm = 2 * gemma.block_size * gemma.n_embd * 2 / 8  # read and write T h / t, bf16
    assert ops.moves == fewer.moves + [norm, norm] and ops.gemms == fewer.gemms


@pytest.mark.parametrize("name", ["llama2-7b", "llama3-70b"])
def test_tensor_parallel_shards_add_up(name):
    spec, tp = NAMED[name], 8
    L, h = spec.n_layer, spec.n_embd
    per_rank = rank_params(spec, list(range(L + 2)), tp, 1)
    replicated = 2 * L * h + h  # RMSNorm weights, whole on every tp rank
    assert tp * per_rank - (tp - 1) * replicated == spec.params


def test_block_flops_count_the_gated_mlp_and_gqa():
    spec, mb = NAMED["llama3-8b"], 1
    s, h, f, kv = spec.block_size, spec.n_embd, spec.ffn_hidden, 8 * 128
    assert block_flops(spec, mb) == 2 * s * (2 * h * h + 2 * h * kv + 3 * h * f) + 4 * s * s * h


def test_tp_must_divide_the_key_value_heads():
    lay = Layout(dp=1, tp=16, pp=1, micro_batch_size=1, micro_batches=1)
    reason = prune_reason(NAMED["llama3-70b"], lay, PRESETS["dgx-h100"], True)
    assert reason == "tp=16 does not divide the 8 key/value heads"


def test_plan_answers_for_llama3_8b(capsys):
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8",
                 "--global-batch", "64", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama3-8b: 8.03B parameters, 32 layers x 4096, sequence 8192")


def test_plan_emits_a_llama_train_config(capsys, tmp_path):
    """A named Llama is written as model.kind = "llama" with its sizes: the config train
    reads describes the same model (parameter count) with the planned layout."""
    from shardwise.base.config import Config
    from shardwise.planner.specs import describe_config, full_size

    out = tmp_path / "tl.toml"
    assert main(["plan", "--model", "tinyllama-1.1b", "--cluster", "dgx-h100", "--gpus", "8",
                 "--global-batch", "64", "--top", "1", "--emit-toml", str(out)]) == 0
    assert "best layout written" in capsys.readouterr().out
    cfg = Config.load(out)
    spec = NAMED["tinyllama-1.1b"]
    m = cfg.model
    assert (m.kind, m.n_layer, m.n_head, m.n_kv_heads, m.n_embd, m.ffn_hidden, m.vocab_size,
            m.block_size, m.tie_weights) == ("llama", 22, 32, 4, 2048, 5632, 32000, 2048, False)
    d = describe_config(cfg)
    assert d.kind == "llama" and full_size(d) == spec.params
    l3 = tmp_path / "l3.toml"
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8",
                 "--global-batch", "64", "--top", "1", "--emit-toml", str(l3)]) == 0
    assert Config.load(l3).model.rope_theta == 500000.0  # Llama 3's rotary base


def test_memory_takes_a_named_size(capsys):
    assert main(["memory", "--model", "llama3-8b", "--dp", "64", "--stages", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama3-8b: P = 8,030,261,248 parameters, N = 64 ranks")


@pytest.mark.parametrize("argv, msg", [
    (["--model", "llama-7b"], "--model 'llama-7b': not a named size"),
    (["--model", "llama3-8b", "--params", "1e9"], "--model and --params: give one"),
])
def test_memory_model_errors_are_one_line(capsys, argv, msg):
    assert_one_line_exit_2(["memory", *argv], capsys, msg)


# ---- specs from a model's description (plan --config, any model.kind) --------------------

LLAMA_SMALL = LlamaConfig(vocab_size=67, block_size=32, n_layer=3, n_head=4, n_kv_heads=2,
                          n_embd=64, ffn_hidden=96)
GPT_SMALL = GPTConfig(vocab_size=67, block_size=32, n_layer=3, n_head=4, n_embd=64)


def _closed(cfg) -> ModelSpec:
    """The spec of ``cfg`` the old way: sizes, closed forms."""
    if isinstance(cfg, LlamaConfig):
        return ModelSpec("c", cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size,
                         cfg.block_size, cfg.tie_weights, False, cfg.n_kv_heads,
                         cfg.ffn_hidden, "llama")
    return ModelSpec("c", cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size,
                     cfg.block_size, cfg.tie_weights, cfg.bias)


@pytest.mark.parametrize("cfg", [LLAMA_SMALL, GPT_SMALL], ids=["llama", "gpt"])
def test_spec_from_description_counts_what_the_closed_forms_count(cfg):
    spec, closed = ModelSpec.from_description(describe(cfg)), _closed(cfg)
    assert spec.family == closed.family and spec.description is not None
    assert (spec.n_layer, spec.n_embd, spec.n_head, spec.kv_heads, spec.ffn, spec.bias,
            spec.tie_weights) == (closed.n_layer, closed.n_embd, closed.n_head,
                                  closed.kv_heads, closed.ffn, closed.bias, closed.tie_weights)
    assert spec.params == closed.params == sum(p.numel() for p in cfg_model(cfg).parameters())
    assert block_flops(spec, 2) == block_flops(closed, 2)
    for tp in (1, 2):
        for pp, v in ((1, 1), (2, 1), (2, 2), (5, 1)):
            for layers in stage_layers(spec, pp, v):
                assert rank_params(spec, layers, tp, pp) == rank_params(closed, layers, tp, pp)


def test_a_shared_expert_of_its_own_width_and_its_gate_are_counted():
    """A Llama with 4 experts and a Qwen2-MoE's shared expert (its own width 40, its sigmoid
    gate): the closed forms (``moe_shared_ffn``, ``moe_shared_gate``) count what the model
    built on meta holds and what every (tp, ep) rank keeps (the gate whole, as the router);
    the FLOPs count the shared expert and its gate for every token; the emitted [model]
    table describes the same model."""
    cfg = LlamaConfig(vocab_size=67, block_size=32, n_layer=2, n_head=4, n_kv_heads=2,
                      n_embd=64, ffn_hidden=96, n_experts=4, top_k=2, moe_ffn_hidden=32,
                      moe_shared_expert=True, moe_shared_ffn_hidden=40,
                      moe_shared_expert_gate=True)
    spec = ModelSpec.from_description(describe(cfg))
    assert (spec.moe_shared_ffn, spec.moe_shared_gate) == (40, True)
    closed = ModelSpec("c", 2, 64, 4, 67, 32, False, False, 2, 96, "llama", n_experts=4,
                       top_k=2, moe_ffn_hidden=32, moe_shared_ffn=40, moe_shared_gate=True)
    assert spec.params == closed.params == sum(p.numel() for p in cfg_model(cfg).parameters())
    assert block_flops(spec, 2) == block_flops(closed, 2) == block_flops(
        replace(closed, moe_shared_ffn=0), 2) + 2 * 2 * 32 * (3 * 64 * 40 + 64)
    layers = list(range(cfg.n_layer + 2))
    for tp in (1, 2):
        for ep in (1, 2):
            assert rank_params(spec, layers, tp, 1, ep) == rank_params(closed, layers, tp, 1, ep)
    assert ModelSpec.from_description(closed.model()).params == spec.params


def cfg_model(cfg):
    with torch.device("meta"):
        return describe(cfg).build()


def test_a_head_dim_of_its_own_sets_the_attention_width():
    """A Llama with Qwen3's head_dim (24 where n_embd / n_head is 16), QK-norm and Qwen2's
    Q/K/V biases: the description's and the spec's attention width are H D = 96, the FLOPs
    count Q K^T and P V at that width and the projections at their own sizes, a cp ring
    passes kv_heads x D, and the emitted [model] table builds the same model."""
    from shardwise.base.config import ModelConfig
    from shardwise.models.llama import from_section
    from shardwise.planner.simulate import block_ops, ring_kv_width

    cfg = replace(LLAMA_SMALL, head_dim=24, qk_norm=True, qkv_bias=True)
    d = describe(cfg)
    spec = ModelSpec.from_description(d)
    assert d.attention_width == spec.attn_width == 4 * 24
    s = cfg.block_size
    weights = 64 * 96 + 2 * 64 * 2 * 24 + 96 * 64 + 3 * 64 * 96  # Q, K V, out, SwiGLU
    assert block_flops(spec, 1) == 2 * s * weights + 4 * s * s * 96
    assert sum(block_ops(spec, 1, 1, False, "shardwise", 4).gemms) == block_flops(spec, 1)
    assert ring_kv_width(spec) == 2 * 24
    assert from_section(ModelConfig(**spec.model_table()), 0) == cfg


def test_a_sliding_window_counts_the_keys_a_query_sees():
    """Attention FLOPs under a sliding window of W count min(T, W) keys a query (the band
    whole, as PaLM counts the causal triangle whole: continuous at T = W), per layer: the
    description's FLOPs per token (MFU's numerator) and the spec's count (``attn_keys``),
    Mistral 7B's named size (a window of 4096 at 8192 tokens: half the keys of Llama 2 7B's
    count at that length; Phi-3-mini's, 2047 of 4096); the planner's time prices the
    engine's calls instead (``test_attention_is_priced_as_the_engine_calls_it``). The
    emitted [model] table keeps the window and where it lies."""
    from shardwise.base.config import ModelConfig
    from shardwise.models.llama import from_section
    from shardwise.planner.simulate import attention_gemm_flops, block_ops

    s = LLAMA_SMALL.block_size
    flat = describe(LLAMA_SMALL)
    for window, types, keys in ((8, None, 3 * 8), (8, ("full_attention", "sliding_attention",
                                                        "full_attention"), 2 * s + 8),
                                (s, None, 3 * s), (100, None, 3 * s)):
        cfg = replace(LLAMA_SMALL, sliding_window=window, layer_types=types)
        d = describe(cfg)
        assert d.attention_keys() == keys
        model = cfg_model(cfg)
        assert d.flops_per_token(model) - flat.flops_per_token(model) == 12 * 64 * (
            keys - 3 * s)
        spec = ModelSpec.from_description(d)
        assert spec.attn_keys == keys / 3
        assert sum(block_ops(spec, 2, 1, False, "shardwise", 4).gemms) == pytest.approx(
            block_flops(spec, 2), rel=1e-12)
        assert from_section(ModelConfig(**spec.model_table()), 0) == cfg
    mistral, llama2 = NAMED["mistral-7b"], NAMED["llama2-7b"]
    assert mistral.attention_windows == (4096,) * 32 and mistral.attn_keys == 4096
    assert mistral.attn_keys * 2 == llama2.with_seq(8192).attn_keys
    # the engine's two chunks of 4096 queries score 4096 and 8191 keys, masked: 2 a pair
    assert attention_gemm_flops(mistral, 1) == 4 * 8192 * (4096 + 8191) * 4096
    assert mistral.with_seq(2048).attn_keys == 2048  # shorter than the window: all of them
    assert mistral.model().config.windows == (4096,) * 32
    phi3 = NAMED["phi3-mini"]  # Phi-3-mini-4k's window of 2047, planned as the checkpoint's
    assert phi3.attention_windows == (2047,) * 32 and phi3.attn_keys == 2047
    assert phi3.model_table()["sliding_window"] == 2047 and not NAMED["phi4"].attention_windows


@pytest.mark.parametrize("window,types,documents,attention,softcap", [
    (None, None, False, "sdpa", None),    # is_causal: the triangle counted whole
    (None, None, True, "sdpa", None),     # one (s, s) call with document masks
    (100, None, False, "sdpa", None),     # chunks of 256 from 2W: 3 calls, the last partial
    (100, None, True, "sdpa", None),      # the same ANDed with the documents
    (400, None, False, "sdpa", None),     # W < s < 2W: one call with the (s, s) band
    (100, ("full_attention", "sliding_attention"), True, "sdpa", None),  # mixed layers
    (100, None, False, "math", None),     # written out: every pair at GEMM price
    (None, None, True, "sdpa", 30.0),     # a soft cap writes the scores out too
])
def test_attention_is_priced_as_the_engine_calls_it(monkeypatch, window, types, documents,
                                                    attention, softcap):
    """The planner's attention (``planner.attention``) is the engine's: every call
    ``causal_attention`` makes on a real forward, recorded, gives the keys a query is
    priced against (a fused call's pairs at ``FUSED_PAIR`` = 2 when it is given a mask, at
    1 as ``is_causal``, counted whole; written-out scores at 1 a pair) and the scores a
    query writes, averaged over the blocks."""
    from shardwise.models import gpt, sequence

    s, eos = 600, 3
    cfg = replace(LLAMA_SMALL, block_size=s, n_layer=2, sliding_window=window,
                  layer_types=types, attention=attention, attn_logit_softcapping=softcap,
                  attention_mask="block_causal" if documents else "causal")
    calls, attend = [], gpt._attend

    def record(q, k, v, mask, dropout_p, impl, scale, cap):
        written = impl != "sdpa" or cap is not None
        calls.append((q.shape[-2] * k.shape[-2], mask is not None and not written))
        return attend(q, k, v, mask, dropout_p, impl, scale, cap)

    monkeypatch.setattr(gpt, "_attend", record)
    torch.manual_seed(0)
    idx = torch.randint(0, 67, (2, s))
    idx[:, ::97] = eos
    shard = sequence.SequenceShard(documents=sequence.document_ids(idx, eos) if documents
                                   else None)
    with torch.no_grad(), sequence.use(shard):
        Llama(cfg)(idx)
    priced = sum(pairs * (2 if masked else 1) for pairs, masked in calls) / s / 2
    written = sum(pairs for pairs, _ in calls) / s / 2
    spec = ModelSpec.from_description(describe(cfg))
    assert spec.model_table().get("attention_mask", "causal") == cfg.attention_mask
    got = spec.attention_calls
    assert got.priced_keys == pytest.approx(priced, rel=1e-12)
    assert got.written_keys == pytest.approx(written, rel=1e-12)
    assert len(calls) > 2 or window is None or window >= s // 2  # chunks were run


def test_exact_small_model_bytes_build_the_llama():
    """Below the exact limit the planner packs the Llama's own buckets (predict_rank), as it
    does the GPT's: bucket padding included (the closed form has none)."""
    spec = _closed(LLAMA_SMALL)
    for dp, tp, pp, zero in ((3, 1, 1, 1), (3, 2, 1, 2), (3, 1, 2, 2), (2, 1, 2, 3),
                             (3, 2, 2, 3)):
        got = static_bytes(spec, dp, tp, pp, 1, zero, "bf16", bucket_mb=0.01)
        want = max((predict_rank(LLAMA_SMALL, dp=dp, pp=pp, tp=tp, pp_rank=pr, tp_rank=tr,
                                 zero=zero, precision="bf16", bucket_mb=0.01)
                    for pr in range(pp) for tr in range(tp)), key=lambda r: r["total"])
        assert got == {k: want[k] for k in ("params", "grads", "optimizer", "total")}


def test_exact_bytes_build_each_rank_once_for_every_dp_zero_and_precision():
    """The exact path builds a rank's model once (``memory._rank_model``) and prices every
    dp, ZeRO stage, cp and precision on it: the bytes stay those of a fresh
    ``predict_rank`` (which converts the parameters' dtype in place: bf16 after fp32 and
    back again must not leak), and only the distinct (pp, pp rank, tp, tp rank) build."""
    from shardwise.planner import memory as pm

    spec = _closed(LLAMA_SMALL)
    pm._rank_model.cache_clear()
    pm.static_bytes.cache_clear()
    cases = [(dp, tp, pp, zero, prec, cp) for prec in ("fp32", "bf16", "fp32")
             for dp, tp, pp, zero, cp in ((3, 2, 2, 1, 1), (2, 2, 2, 2, 1), (4, 2, 2, 1, 2),
                                          (3, 1, 1, 3, 1), (2, 1, 1, 2, 2))]
    for dp, tp, pp, zero, prec, cp in cases:
        got = pm.static_bytes(spec, dp, tp, pp, 1, zero, prec, bucket_mb=0.01, cp=cp)
        want = max((predict_rank(LLAMA_SMALL, dp=dp, pp=pp, tp=tp, pp_rank=pr, tp_rank=tr,
                                 zero=zero, precision=prec, bucket_mb=0.01, cp=cp)
                    for pr in range(pp) for tr in sorted({0, tp - 1})),
                   key=lambda r: r["total"])
        assert got == {k: want[k] for k in ("params", "grads", "optimizer", "total")}, (
            dp, tp, pp, zero, prec, cp)
    assert pm._rank_model.cache_info().misses == 2 * 2 + 1  # pp2 x tp2's corners, pp1 tp1


# a model of its own kind: no attention, a 3h two-layer MLP per block, no biases, untied


@dataclass(frozen=True)
class MLPDecoderConfig:
    vocab_size: int
    block_size: int = 32
    n_layer: int = 2
    n_embd: int = 32


class _Embed(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.tok = nn.Embedding(c.vocab_size, c.n_embd)

    def forward(self, idx):
        return self.tok(idx)


class _Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = nn.LayerNorm(c.n_embd)
        self.fc = nn.Linear(c.n_embd, 3 * c.n_embd, bias=False)
        self.proj = nn.Linear(3 * c.n_embd, c.n_embd, bias=False)

    def forward(self, x):
        return x + self.proj(torch.relu(self.fc(self.norm(x))))


class _Head(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.proj = nn.Linear(c.n_embd, c.vocab_size, bias=False)

    def forward(self, x):
        return self.proj(x)


class MLPDecoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed = _Embed(c)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layer))
        self.head = _Head(c)


def _describe_mlp(c: MLPDecoderConfig) -> ModelDescription:
    return ModelDescription(
        kind="mlp_decoder", config=c, build=lambda: MLPDecoder(c),
        tp_plan={"embed.tok": "vocab_embedding", "blocks.*.fc": "column",
                 "blocks.*.proj": "row", "head.proj": "vocab_head"},
        hidden_size=c.n_embd, vocab_size=c.vocab_size, block_size=c.block_size,
        n_layer=c.n_layer, attention_width=0,
        tp_divides={"MLP width 3 * model.n_embd": 3 * c.n_embd})


register_model("mlp_decoder", MLPDecoderConfig, _describe_mlp,
               lambda m, vocab: MLPDecoderConfig(m.vocab_size or vocab, m.block_size,
                                                 m.n_layer, m.n_embd))

MLP_TOML = """[model]
kind = "mlp_decoder"
n_layer = 3
n_head = 2
n_embd = 32
block_size = 16
vocab_size = 61
"""

LLAMA_TOML = """[model]
kind = "llama"
n_layer = 2
n_head = 4
n_kv_heads = 2
n_embd = 64
ffn_hidden = 96
block_size = 32
vocab_size = 67
"""


def test_registered_kind_is_planned_from_its_own_layers(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(MLP_TOML)
    spec = load_model(str(path))
    d = describe(MLPDecoderConfig(61, 16, 3, 32))
    assert (spec.name, spec.family, spec.n_layer, spec.n_embd, spec.bias, spec.tie_weights) == \
        ("mine", "mlp_decoder", 3, 32, False, False)
    assert spec.params == 61 * 32 * 2 + 3 * (2 * 32 + 6 * 32 * 32)
    assert block_flops(spec, 1) == 2 * 16 * 6 * 32 * 32  # its matrices, no attention
    # every rank's parameters, as the engine builds it (the closed forms of a GPT would
    # count attention and position tables this model does not have)
    for tp in (1, 2, 4):
        for pp in (1, 2, 3):
            for pr, layers in enumerate(stage_layers(spec, pp)):
                for tr in range(tp):
                    want = predict_rank(d, pp=pp, tp=tp, pp_rank=pr, tp_rank=tr)["params"] // 4
                    assert rank_params(spec, layers, tp, pp) == want, (tp, pp, pr)
    # tp must divide what the model says (3 * 32 = 96: not 64), not a GPT's heads
    lay = Layout(dp=1, tp=64, pp=1, micro_batch_size=1, micro_batches=1)
    assert prune_reason(spec, lay, PRESETS["dgx-h100"], True) == \
        "tp=64 does not divide MLP width 3 * model.n_embd = 96"
    feasible, _ = plan(spec, PRESETS["dgx-h100"], 4, 8, simulate_top=5)
    assert feasible
    # --seq describes the model again at that length
    assert load_model(str(path), 8).block_size == spec.with_seq(8).block_size == 8


@pytest.mark.parametrize("text, kind", [(LLAMA_TOML, "llama"), (MLP_TOML, "mlp_decoder")],
                         ids=["llama", "registered"])
def test_plan_takes_a_config_of_any_kind(capsys, tmp_path, text, kind):
    path = tmp_path / "run.toml"
    path.write_text(text)
    for flag in ("--config", "--model"):
        assert main(["plan", flag, str(path), "--cluster", "dgx-h100", "--gpus", "4",
                     "--global-batch", "8", "--top", "2"]) == 0
        head = capsys.readouterr().out.splitlines()[0]
        assert head.startswith("run: ") and f"model.kind {kind};" in head


@pytest.mark.parametrize("text, cfg", [
    (LLAMA_TOML, LlamaConfig(vocab_size=67, block_size=32, n_layer=2, n_head=4, n_kv_heads=2,
                             n_embd=64, ffn_hidden=96)),
    (LLAMA_TOML + "head_dim = 24\nqk_norm = true\nqkv_bias = true\n",
     LlamaConfig(vocab_size=67, block_size=32, n_layer=2, n_head=4, n_kv_heads=2, n_embd=64,
                 ffn_hidden=96, head_dim=24, qk_norm=True, qkv_bias=True)),
    (MLP_TOML, MLPDecoderConfig(61, 16, 3, 32))], ids=["llama", "llama-qwen-options",
                                                       "registered"])
def test_memory_config_predicts_the_configured_kind(capsys, tmp_path, text, cfg):
    """``shardwise memory --config`` predicts the model train builds (model.kind), every
    rank of the layout, and names its kind."""
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert main(["memory", "--config", str(path), "--dp", "2", "--tp", "2", "--pp", "2",
                 "--stages", "1,2"]) == 0
    out = capsys.readouterr().out.splitlines()
    kind = describe(cfg).kind
    n = sum(p.numel() for p in cfg_model(cfg).parameters())
    assert out[0].startswith(f"{kind} {n / 1e6:.2f}M parameters, ")
    assert "bytes per rank in MiB" in out[0]
    rows = [line.split() for line in out[2:]]
    assert len(rows) == 8
    for z, pr, tr, *vals in rows:
        want = predict_rank(cfg, dp=2, pp=2, tp=2, pp_rank=int(pr), tp_rank=int(tr),
                            zero=int(z), precision="fp32")  # the config's (its default)
        assert float(vals[-1]) == pytest.approx(want["total"] / 2**20, abs=6e-4), (z, pr, tr)


@pytest.mark.parametrize("model, argv, msg", [
    ('kind = "nosuch"\n', [], "model.kind='nosuch': not a registered model (gpt, llama"),
    ('kind = "llama"\nn_head = 4\nn_kv_heads = 2\nn_embd = 64\nvocab_size = 67\n',
     ["--tp", "4"], "model.n_kv_heads (key/value heads)"),
    ('kind = "llama"\nn_head = 4\nn_kv_heads = 3\nn_embd = 64\nvocab_size = 67\n',
     [], "model.n_head=4 is not divisible by model.n_kv_heads=3"),
    ('kind = "cnn"\n', [], "model.kind=cnn"),
])
def test_memory_config_errors_are_one_line(capsys, tmp_path, model, argv, msg):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\n" + model)
    err = assert_one_line_exit_2(["memory", "--config", str(path), "--dp", "1", *argv], capsys,
                                 msg)
    assert err.startswith("shardwise memory: error: "), err


def test_local_calibration_times_the_planned_models_block():
    from shardwise.models.llama import Block
    from shardwise.planner.hardware import calibration_block

    blk, width, attn = calibration_block(64, 16, 4, _closed(LLAMA_SMALL))
    assert isinstance(blk, Block) and (width, attn) == (64, 64)
    assert not any(p.is_meta for p in blk.parameters())
    spec = load_model_text(MLP_TOML)
    blk, width, attn = calibration_block(32, 16, 2, spec)
    assert isinstance(blk, _Block) and (width, attn) == (32, 0)


def test_a_named_size_is_calibrated_on_a_narrowed_block_of_its_shape():
    """``--cluster local`` times one block of the planned model; a named size's is narrowed
    to about ``CALIBRATION_WIDTH`` (Llama-3-8B's own block, 218M weights, took minutes at
    one thread): the same heads and key/value heads, an even head dimension, the MLP and
    expert widths scaled alike; a narrow one is timed as it is."""
    from shardwise.models.llama import Block
    from shardwise.planner.hardware import CALIBRATION_WIDTH, calibration_block, calibration_spec

    big = NAMED["llama3-8b"]
    small = calibration_spec(big, 64)
    assert (small.n_head, small.kv_heads, small.n_layer, small.block_size) == (32, 8, 1, 64)
    assert small.n_embd == 256 and (small.n_embd // small.n_head) % 2 == 0
    assert small.ffn == round(big.ffn * 256 / 4096)
    moe = calibration_spec(NAMED["mixtral-8x7b"], 64)
    assert moe.n_experts == 8 and moe.expert_ffn == round(NAMED["mixtral-8x7b"].expert_ffn / 16)
    for name in ("gpt3-175b", "llama3-405b", "gpt2-124m"):  # 96, 128 and 12 heads
        s = calibration_spec(NAMED[name], 64)
        assert s.n_embd <= CALIBRATION_WIDTH + s.n_head and s.n_embd % (2 * s.n_head) == 0
    blk, width, attn = calibration_block(big.n_embd, 64, big.n_head, big)
    assert isinstance(blk, Block) and width == attn == 256
    assert sum(p.numel() for p in blk.parameters()) < 2e6  # 218M at Llama-3-8B's width
    narrow = replace(big, n_embd=128, n_head=4, n_kv_heads=2, ffn_hidden=344)
    assert calibration_spec(narrow, 64) == replace(narrow, n_layer=1, block_size=64)


def load_model_text(text: str) -> ModelSpec:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.toml"
        path.write_text(text)
        return load_model(str(path))


@pytest.mark.slow  # emit -> train: test_planner.py::test_emitted_toml_trains, the README
def test_emitted_llama_toml_trains(corpus, tmp_path):
    """``plan --config`` of a Llama config writes a layout ``shardwise train`` runs as is."""
    src = tmp_path / "llama.toml"
    src.write_text(LLAMA_TOML.replace("vocab_size = 67\n", "") +
                   f'\n[data]\npath = "{corpus}"\n\n[training]\nsteps = 2\neval_every = 0\n'
                   f'sample_chars = 0\nprogress = false\nout_dir = "{tmp_path / "run"}"\n\n'
                   '[checkpoint]\nat_end = false\n')
    out = tmp_path / "best.toml"
    r = run_shardwise("plan", "--config", str(src), "--cluster", "dgx-h100", "--gpus", "2",
                      "--global-batch", "8", "--precision", "fp32", "--emit-toml", str(out),
                      cwd=None)
    assert r.returncode == 0, r.stderr
    assert 'kind = "llama"' in out.read_text()
    t = run_shardwise("train", "--config", str(out), cwd=None)
    assert t.returncode == 0, t.stderr
    assert "shardwise: llama " in t.stdout and "done: 2 steps" in t.stdout


def test_plan_says_a_small_model_in_millions_or_thousands():
    """The header's parameter count: 8.03B, 124.4M, 29.12K (configs/tiny.toml's was
    2.912e-05B)."""
    from shardwise.cli.plan import parameter_count

    assert [parameter_count(n) for n in (8_030_261_248, 124_439_808, 29_120, 512)] == [
        "8.03B", "124.4M", "29.12K", "512"]
