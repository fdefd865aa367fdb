"""Small random-weight ``transformers`` checkpoints, one or more per architecture shardwise
reads and writes (``models.hf.ARCHS``), shared by ``tests/test_hf.py`` (its ``hf_dirs``
fixture) and ``benchmarks/hf_parity.py``. Imported by bare name (``from hf_models import
save``: conftest puts tests/ on ``sys.path``; the benchmark does the same). No pytest here.

Every model is 2 layers of 64 wide (the DeepSeeks 3 of 32), a vocabulary of ``VOCAB``, its
weights ``torch.manual_seed(0)``, the class's init, then ``perturb`` (away from the init:
norms away from 1, biases from 0), saved with ``save_pretrained`` (no hub), so each
checkpoint is the same whatever else is built in the process."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

VOCAB = 97  # more than the text's characters: the tokenizer may be smaller than the model's
WINDOW = 8  # the sliding window of the *_swa checkpoints, a quarter of the 32 tokens fed
# Gemma 3 4B-27B's rotary (global layers: base 1e6, linear factor 8; sliding: base 1e4)
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
# the sizes every dense checkpoint shares: grouped-query attention, 4 heads over 2
_DENSE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)
_NO_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
_GEMMA = {**_DENSE, "head_dim": 24,  # not 64 / 4
          "max_position_embeddings": 32, **_NO_TOKENS}


def perturb(model):
    """Random weights away from the init (norms away from 1, biases away from 0)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _llama():
    """Grouped-query attention, untied head (saved sharded: ``save``)."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **_DENSE, max_position_embeddings=32, tie_word_embeddings=False))


def _gpt2():
    """Tied head, Conv1D weights, one safetensors file."""
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
        eos_token_id=0))


def _mixtral():
    """Top 2 of 4 experts; the Hub's per-expert w1/w2/w3 on disk."""
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **{**_DENSE, "intermediate_size": 48}, max_position_embeddings=32,
        num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02))


def _qwen2():
    """Q/K/V biases, tied head, rope_theta 1e6."""
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **_DENSE, max_position_embeddings=32, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def _qwen3():
    """q_norm / k_norm, head_dim 24 where hidden / heads is 16."""
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **_DENSE, head_dim=24, max_position_embeddings=32, tie_word_embeddings=False,
        rms_norm_eps=1e-6))


def _qwen3moe(norm: bool = True):
    """Top 2 of 4 experts of width 40, head_dim 24, ``norm_topk_prob`` ``norm``."""
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **_DENSE, moe_intermediate_size=40, head_dim=24, max_position_embeddings=32,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm, router_aux_loss_coef=0.02,
        tie_word_embeddings=False))


def _qwen2moe(window: bool = False):
    """Q/K/V biases, top 2 of 4 experts of width 40, a shared expert of width 56 and its
    sigmoid gate, top k not renormalised; ``window``: ``use_sliding_window`` in its default
    pattern (layer 0) and ``Qwen2MoeConfig``'s default aux loss coefficient."""
    extra = (dict(use_sliding_window=True, sliding_window=WINDOW) if window else
             dict(norm_topk_prob=False, router_aux_loss_coef=0.02))
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **_DENSE, moe_intermediate_size=40, shared_expert_intermediate_size=56,
        max_position_embeddings=32, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False, **extra))


def _mistral():
    """Mistral-Nemo's shape in small: head_dim 12 where hidden / heads is 16, no window,
    rope_theta 1e6."""
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        **_DENSE, head_dim=12, max_position_embeddings=32, sliding_window=None,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                    "rope_theta": 1e6}))


def _phi3():
    """Phi-4-mini's shape in small: Q/K/V and gate/up packed, 12 of each head's 16 features
    rotated, LongRoPE from 32 tokens to 128, tied head."""
    factors = (1 + torch.rand(2, 6, generator=torch.Generator().manual_seed(7))).tolist()
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **_DENSE, max_position_embeddings=128, original_max_position_embeddings=32,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                         "partial_rotary_factor": 0.75, "short_factor": factors[0],
                         "long_factor": [2 * f for f in factors[1]]},
        tie_word_embeddings=True, **_NO_TOKENS))


def _mistral_swa():
    """A window of ``WINDOW`` on every layer."""
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        **_DENSE, max_position_embeddings=32, sliding_window=WINDOW,
        tie_word_embeddings=False))


def _qwen2_swa():
    """``use_sliding_window``, ``max_window_layers`` 1: the window on layer 1 only."""
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **_DENSE, max_position_embeddings=32, tie_word_embeddings=True,
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1))


def _phi3_swa():
    """Phi-3-mini-4k's window in small, on every layer; the default rotary on 10 of each
    head's 16 features."""
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **_DENSE, max_position_embeddings=32, original_max_position_embeddings=32,
        sliding_window=WINDOW, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                "partial_rotary_factor": 0.625},
        tie_word_embeddings=False, **_NO_TOKENS))


def _gemma():
    """head_dim 24 where hidden / heads is 16, tied head."""
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(**_GEMMA))


def _gemma2():
    """A window of 8 on layer 0 (its default pattern), query_pre_attn_scalar 20, soft caps
    2 on the scores and 3 on the logits (small enough to bite), eager attention
    (transformers' only one with a cap)."""
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **_GEMMA, sliding_window=WINDOW, query_pre_attn_scalar=20, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, attn_implementation="eager"))


def _gemma3():
    """A window of 8 on layer 0, QK-norm, query_pre_attn_scalar 20, local rotary base 1e4,
    global 1e6 scaled linearly by 8 (``GEMMA3_ROPE``, as Gemma 3 4B-27B)."""
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **_GEMMA, sliding_window=WINDOW, query_pre_attn_scalar=20, sliding_window_pattern=2,
        rope_parameters=GEMMA3_ROPE))


def _gemma3_vlm():
    """A Gemma 3 4B-27B in small: a ``Gemma3ForConditionalGeneration`` whose language model
    is the Gemma sizes with a window of 8 on layer 0, QK-norm, the rotary of Gemma 3
    4B-27B (``GEMMA3_ROPE``) and ``Gemma3TextConfig``'s own ``query_pre_attn_scalar``
    (256, not head_dim's 24: a default that matters), beside a SigLIP vision tower of one
    layer (hidden 32, 28 x 28 images of 14 x 14 patches) and its projector (4 tokens per
    image). Saved with its text_config as the Hub lists it (``as_released``)."""
    return transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(
            **_GEMMA, sliding_window=WINDOW, sliding_window_pattern=2,
            rope_parameters=GEMMA3_ROPE),
        vision_config=transformers.SiglipVisionConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14),
        mm_tokens_per_image=4))


def _deepseek(version: str):
    """A DeepSeek-V3 or V2 in small: MLA (V3: a query latent of 24; V2: a plain q_proj), 3
    layers, the first dense, 8 experts in 4 groups (the best 2 kept), top 2, two shared
    experts; V3 with a random routing bias (``e_score_correction_bias``), sigmoid gating
    and the interleaved rotary; V2 softmax with ``group_limited_greedy``."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                  moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=12, n_routed_experts=8, n_group=4,
                  topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                  n_shared_experts=2, max_position_embeddings=32, tie_word_embeddings=False)
    if version == "V3":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **common, q_lora_rank=24, routed_scaling_factor=2.5))
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
        return model
    return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        **common, q_lora_rank=None, routed_scaling_factor=1.5,
        topk_method="group_limited_greedy"))


# name -> the unperturbed model; the first of each architecture is its plain checkpoint
BUILDERS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": _llama, "gpt2": _gpt2, "mixtral": _mixtral, "qwen2": _qwen2, "qwen3": _qwen3,
    "qwen2moe": _qwen2moe, "qwen3moe": _qwen3moe,
    "qwen3moe_raw": lambda: _qwen3moe(norm=False), "mistral": _mistral, "phi3": _phi3,
    "gemma": _gemma, "gemma2": _gemma2, "gemma3": _gemma3,
    "deepseek_v3": lambda: _deepseek("V3"), "deepseek_v2": lambda: _deepseek("V2"),
    "gemma3_vlm": _gemma3_vlm, "mistral_swa": _mistral_swa, "qwen2_swa": _qwen2_swa,
    "qwen2moe_swa": lambda: _qwen2moe(window=True), "phi3_swa": _phi3_swa,
}


def build(name: str):
    """``BUILDERS[name]``'s model, seeded (``torch.manual_seed(0)``) and perturbed, in eval
    mode."""
    torch.manual_seed(0)
    return perturb(BUILDERS[name]())


def save(name: str, root: Path) -> Path:
    """``build(name)`` saved to ``root/name`` as transformers does (the Llama sharded into
    several safetensors with an index; the multimodal Gemma 3's text_config cut to what the
    Hub lists, ``as_released``). Returns the directory."""
    path = Path(root) / name
    model = build(name)
    model.save_pretrained(path, **({"max_shard_size": "40KB"} if name == "llama" else {}))
    if name == "gemma3_vlm":
        as_released(path)
    return path


def as_released(path: Path) -> None:
    """``path/config.json``'s ``text_config`` cut to the fields that differ from
    ``Gemma3TextConfig``'s defaults, as the Hub's Gemma 3 files list it (the reader must
    fill the rest as transformers does)."""
    config = json.loads((path / "config.json").read_text())
    defaults = transformers.Gemma3TextConfig().to_dict()
    config["text_config"] = {k: v for k, v in config["text_config"].items()
                             if k == "model_type" or k not in defaults or v != defaults[k]}
    assert "query_pre_attn_scalar" not in config["text_config"]
    (path / "config.json").write_text(json.dumps(config))
