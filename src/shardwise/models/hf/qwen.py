"""``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen2MoeForCausalLM`` and
``Qwen3MoeForCausalLM`` (``QWEN2``, ``QWEN3``, ``QWEN2_MOE``, ``QWEN3_MOE``).

``Qwen2ForCausalLM`` (Yang et al. 2024, "Qwen2 Technical Report", arXiv:2407.10671;
``models/qwen2/modeling_qwen2.py``): our Llama with Q/K/V biases; ``Qwen3ForCausalLM`` (Yang
et al. 2025, "Qwen3 Technical Report", arXiv:2505.09388; ``models/qwen3/modeling_qwen3.py``):
with QK-norm and its ``head_dim`` (the options of each: ``arch.OPTIONS``); both with Llama's
names (``self_attn.q_proj.bias``, ``self_attn.q_norm.weight``), a sliding window
(``use_sliding_window``) on the layers ``layer_types`` marks "sliding_attention" (default:
from ``max_window_layers`` on) our ``sliding_window`` and ``layer_types``.
``Qwen3MoeForCausalLM`` (same report; ``models/qwen3_moe/modeling_qwen3_moe.py``): Qwen3's
attention and experts in every layer, softmax top-k renormalised only with
``norm_topk_prob``; per-expert ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` (out, in)
on disk, stacked (E, in, out) in ours (``models.hf.moe._moe_tensor``).
``Qwen2MoeForCausalLM`` (Qwen1.5-MoE-A2.7B,
Qwen2-57B-A14B; the Qwen2 report; ``models/qwen2_moe/modeling_qwen2_moe.py``): Qwen2's
attention (Q/K/V biases) and the same experts, plus a shared expert of its own width whose
output is scaled by ``sigmoid(mlp.shared_expert_gate(x))`` (``moe_shared_expert_gate``).
"""

from __future__ import annotations

from shardwise.models.hf.arch import (
    _ATTENTION_TYPES,
    _LAYER_TYPE,
    _NO_WINDOW,
    HFArch,
    HFConfigError,
    HFTensor,
    _dense,
    _full_rotary,
    _plain,
    _refuse,
    _uniform,
    _window,
    _windowless,
    fixes,
    options,
)
from shardwise.models.hf.llama import _llama_config_json, _llama_section, llama_hf_name
from shardwise.models.hf.moe import _QWEN_MOE_EXPERTS, _moe_tensor, _softmax_dropless

# transformers' Qwen2Config / Qwen3Config defaults (configuration_qwen2.py / _qwen3.py), where
# they differ from the Llama's, for a config.json that leaves a field out
_QWEN_DEFAULTS = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                  "num_key_value_heads": 32, "use_sliding_window": False,
                  "sliding_window": 4096, "max_window_layers": 28}


def _qwen_window(c: dict) -> dict:
    """The [model] window fields of a Qwen config.json (``_window``): as ``Qwen2Config`` /
    ``Qwen3Config``, the window is ``sliding_window`` when ``use_sliding_window`` (else
    none), on the layers ``layer_types`` marks "sliding_attention" (default: those from
    ``max_window_layers`` on)."""
    c = {**_QWEN_DEFAULTS, **{k: v for k, v in c.items() if v is not None}}
    if not c["use_sliding_window"]:
        return {**_NO_WINDOW}
    n = c.get("num_hidden_layers", 0)
    types = c.get("layer_types") or ["sliding_attention" if i >= c["max_window_layers"]
                                     else "full_attention" for i in range(n)]
    return _window(c.get("sliding_window"), types)


def _qwen_section(c: dict, arch: str) -> dict:
    """A Qwen2 (``arch`` "Qwen2") is our Llama with Q/K/V biases, a Qwen3 with QK-norm
    (their ``OPTIONS``) and Qwen3's ``head_dim`` (default 128, as ``Qwen3Config``); no
    ``attention_bias`` on a Qwen3 (its o_proj would have one too). Its window
    (``_qwen_window``): our ``sliding_window`` and ``layer_types``."""
    kv = c["num_attention_heads"] if "num_key_value_heads" in c else None  # null: MHA
    c = {**_QWEN_DEFAULTS, **({"head_dim": 128} if arch == "Qwen3" else {}),
         **({"num_key_value_heads": kv} if kv is not None else {}),
         **{k: v for k, v in c.items() if v is not None}}
    types = c.get("layer_types") or []
    bad = [t for t in types if t not in _ATTENTION_TYPES]
    if bad:
        raise _refuse(arch, f"layer_types has {bad[0]!r} (expected "
                      f"{' or '.join(_ATTENTION_TYPES)})")
    if arch == "Qwen2":
        c.pop("attention_bias", None)  # Qwen2's Q, K, V always have biases, o_proj none
    out = _llama_section(c, arch)
    out.update(options(arch), **_qwen_window(c))
    return out


def _qwen_window_json(cfg, out: dict) -> dict:
    """A Qwen config.json's window fields of a Llama config: ``use_sliding_window`` when
    any block has a window, ``sliding_window`` its W (else the source's, unused), and
    ``layer_types`` per block (written out, so ``max_window_layers`` is not read)."""
    return dict(use_sliding_window=not _windowless(cfg),
                sliding_window=(out.get("sliding_window") if _windowless(cfg)
                                else cfg.sliding_window),
                max_window_layers=out.get("max_window_layers", cfg.n_layer),
                layer_types=[_LAYER_TYPE[w is not None] for w in cfg.windows])


def _qwen_config_json(cfg, source: dict | None, arch: str) -> dict:
    out = _llama_config_json(cfg, source)
    for llama_only in ("attention_bias", "mlp_bias", "pretraining_tp"):
        out.pop(llama_only, None)
    out.update(architectures=[f"{arch}ForCausalLM"], model_type=arch.lower(),
               **_qwen_window_json(cfg, out))
    if arch == "Qwen3":
        out["attention_bias"] = False
    return out


def _qwen_tensor(name: str) -> HFTensor:
    """Llama's names: the biases are ``self_attn.{q,k,v}_proj.bias``, the QK-norms
    ``self_attn.q_norm.weight`` / ``k_norm.weight`` (D,), ours and theirs alike."""
    return HFTensor(llama_hf_name(name))


# transformers' Qwen2MoeConfig / Qwen3MoeConfig defaults (configuration_qwen2_moe.py /
# _qwen3_moe.py), where they differ from the Llama's, for a config.json that leaves a field
# out; head_dim: hidden / heads, as Llama's
_QWEN_MOE_COMMON = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                    "use_sliding_window": False, "sliding_window": 4096,
                    "decoder_sparse_step": 1, "norm_topk_prob": False,
                    "router_aux_loss_coef": 0.001}
_QWEN_MOE_DEFAULTS = {
    "Qwen2-MoE": {**_QWEN_MOE_COMMON, "num_key_value_heads": 16, "intermediate_size": 5632,
                  "max_window_layers": 28, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4,
                  "num_experts": 60, "qkv_bias": True},
    "Qwen3-MoE": {**_QWEN_MOE_COMMON, "num_key_value_heads": 4, "intermediate_size": 6144,
                  "moe_intermediate_size": 768, "num_experts_per_tok": 8,
                  "num_experts": 128}}


def _qwen_moe_defaults(c: dict, arch: str) -> dict:
    c = dict(c)
    # the Hub's config.json names the expert count num_experts; Qwen3-MoE's save_pretrained
    # writes num_local_experts (Qwen3MoeConfig.attribute_map)
    if c.get("num_experts") is None and c.get("num_local_experts") is not None:
        c["num_experts"] = c["num_local_experts"]
    return {**_QWEN_MOE_DEFAULTS[arch], **{k: v for k, v in c.items() if v is not None}}


def _qwen_moe_window(c: dict, arch: str) -> dict:
    """The [model] window fields of a Qwen-MoE config.json (``_window``):
    ``sliding_window`` when ``use_sliding_window``, else none; a Qwen3-MoE's on every
    layer, a Qwen2-MoE's on the layers ``layer_types`` marks "sliding_attention" (default,
    as ``Qwen2MoeConfig``: the even layers below ``max_window_layers``)."""
    c = _qwen_moe_defaults(c, arch)
    if not c["use_sliding_window"]:
        return {**_NO_WINDOW}
    if arch == "Qwen3-MoE":
        return _window(c.get("sliding_window"))
    types = c.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 and i < c["max_window_layers"]
        else "full_attention" for i in range(c.get("num_hidden_layers", 0))]
    return _window(c.get("sliding_window"), types)


def _qwen_moe_section(c: dict, arch: str) -> dict:
    """A Qwen-MoE is our Llama with ``n_experts`` in every layer (``models.moe``): routing as
    ``Qwen2MoeTopKRouter`` / ``Qwen3MoeTopKRouter`` (softmax over all experts in fp32, top
    k, renormalised only with ``norm_topk_prob``: ``moe_norm_topk``), experts of width
    ``moe_intermediate_size``, dropless. A Qwen3-MoE has Qwen3's QK-norm and ``head_dim``
    and no shared expert (its ``OPTIONS``); a Qwen2-MoE has Q/K/V biases (``qkv_bias``,
    default true) and a shared expert of width ``shared_expert_intermediate_size`` whose output is
    scaled by ``sigmoid(shared_expert_gate(x))`` (``moe_shared_expert_gate``). The layers
    whose MLP is dense, of width ``intermediate_size`` (``Qwen2MoeDecoderLayer``: those in
    ``mlp_only_layers`` and those i with (i + 1) not a multiple of ``decoder_sparse_step``),
    are our ``dense_layers``; a model with no mixture left is refused. Its window
    (``_qwen_moe_window``): our ``sliding_window`` and ``layer_types``."""
    c = _qwen_moe_defaults(c, arch)
    step, n_layer = c["decoder_sparse_step"], c.get("num_hidden_layers", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise HFConfigError(f"config.json: decoder_sparse_step={step!r}: expected a whole "
                            "number >= 1")
    only = c.get("mlp_only_layers") or []
    if any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise HFConfigError(f"config.json: mlp_only_layers={list(only)!r}: expected layer "
                            "indices")
    dense = sorted({i for i in only if 0 <= i < n_layer}
                   | {i for i in range(n_layer) if (i + 1) % step})
    if n_layer and len(dense) == n_layer:
        raise _refuse(arch, f"decoder_sparse_step={step} / mlp_only_layers={list(only)!r} "
                      "leave no layer with experts (load it as a dense model)")
    if not c["num_experts"]:
        raise _refuse(arch, f"num_experts=0 (a dense {arch}: every layer's MLP dense; "
                      "shardwise loads it only with experts)")
    types = c.get("layer_types") or []
    bad = [t for t in types if t not in _ATTENTION_TYPES]
    if bad:
        raise _refuse(arch, f"layer_types has {bad[0]!r} (expected "
                      f"{' or '.join(_ATTENTION_TYPES)})")
    out = _llama_section(c, arch)
    out.update(_qwen_moe_window(c, arch))
    out.update(moe_ffn_hidden=c["moe_intermediate_size"], n_experts=c["num_experts"],
               top_k=c["num_experts_per_tok"], moe_gating="softmax",
               moe_norm_topk=bool(c["norm_topk_prob"]),
               moe_aux_loss_coef=float(c["router_aux_loss_coef"]), moe_capacity_factor=0.0,
               moe_shared_expert=False, moe_shared_ffn_hidden=0, moe_shared_expert_gate=False,
               dense_layers=dense)
    out.update(options(arch))
    if arch == "Qwen3-MoE":
        return out
    shared = c["shared_expert_intermediate_size"]
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 1:
        raise _refuse(arch, f"shared_expert_intermediate_size={shared!r} (shardwise's "
                      "shared expert has a width >= 1)")
    out.update(qkv_bias=bool(c["qkv_bias"]), moe_shared_expert=True,
               moe_shared_ffn_hidden=shared, moe_shared_expert_gate=True)
    return out


def _qwen_moe_config_json(cfg, source: dict | None, arch: str) -> dict:
    out = _llama_config_json(cfg, source)
    for other in ("mlp_bias", "pretraining_tp", "num_local_experts"):
        out.pop(other, None)
    # intermediate_size: the dense layers' width (mlp_only_layers)
    base = arch.removesuffix("-MoE")
    window = _qwen_window_json(cfg, out)
    out.update(architectures=[f"{base}MoeForCausalLM"], model_type=f"{base.lower()}_moe",
               moe_intermediate_size=cfg.moe_ffn_hidden,
               num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
               norm_topk_prob=cfg.moe_norm_topk, router_aux_loss_coef=cfg.moe_aux_loss_coef,
               decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layers),
               use_sliding_window=window["use_sliding_window"],
               sliding_window=window["sliding_window"],
               output_router_logits=bool(out.get("output_router_logits", False)))
    if arch == "Qwen3-MoE":  # one window on every layer (holds: _uniform)
        out["attention_bias"] = False
        return out
    out.pop("attention_bias", None)  # Qwen2-MoE's is qkv_bias (Q, K, V; o_proj none)
    out.update(qkv_bias=cfg.qkv_bias, shared_expert_intermediate_size=cfg.moe_shared_ffn_hidden,
               max_window_layers=window["max_window_layers"], layer_types=window["layer_types"])
    return out


def qwen3_moe_compatible(cfg) -> bool:
    """Whether a Llama config with ``n_experts`` is a Qwen3-MoE exactly: softmax gating
    (the top k renormalised or not: ``norm_topk_prob``), dropless, no shared expert, no
    routing bias (``moe_bias_update_rate`` 0), Qwen3's attention (QK-norm, no Q/K/V
    biases, all of each head rotated), one window on every layer or none."""
    return (_softmax_dropless(cfg) and not cfg.moe_shared_expert and fixes("Qwen3-MoE", cfg)
            and _uniform(cfg) and _full_rotary(cfg) and _plain(cfg))


def qwen2_moe_compatible(cfg) -> bool:
    """Whether a Llama config with ``n_experts`` is a Qwen2-MoE exactly: softmax gating
    (renormalised or not: ``norm_topk_prob``), dropless, no routing bias, a shared expert
    (any width: ``shared_expert_intermediate_size``) with its sigmoid gate
    (``moe_shared_expert_gate``), no QK-norm, all of each head rotated; Q/K/V biases or not
    (``qkv_bias``)."""
    return (_softmax_dropless(cfg) and cfg.moe_shared_expert
            and getattr(cfg, "moe_shared_expert_gate", False)
            and fixes("Qwen2-MoE", cfg) and _full_rotary(cfg) and _plain(cfg))


def _qwen_arch(name: str) -> HFArch:
    """A Qwen's arch (``name``: "Qwen2", "Qwen3", "Qwen2-MoE" or "Qwen3-MoE"): the dense
    ones the same tensors and window, their attention options set by ``_qwen_section``;
    the mixtures of experts ``_qwen_moe_section``'s, their experts as ``_moe_tensor``
    names them (Qwen2-MoE's shared expert and its gate too)."""
    if not name.endswith("-MoE"):
        return HFArch(kind="llama", model_type=name.lower(), architecture=f"{name}ForCausalLM",
                      section=lambda c: _qwen_section(c, name),
                      config_json=lambda cfg, source: _qwen_config_json(cfg, source, name),
                      tensor=_qwen_tensor, ignored=("*.rotary_emb.inv_freq",),
                      at_most=("block_size",), holds=_dense(name))
    base = name.removesuffix("-MoE")
    holds = qwen2_moe_compatible if name == "Qwen2-MoE" else qwen3_moe_compatible
    return HFArch(kind="llama", model_type=f"{base.lower()}_moe",
                  architecture=f"{base}MoeForCausalLM",
                  section=lambda c: _qwen_moe_section(c, name),
                  config_json=lambda cfg, source: _qwen_moe_config_json(cfg, source, name),
                  tensor=_moe_tensor("mlp", _QWEN_MOE_EXPERTS, name,
                                     shared=name == "Qwen2-MoE"),
                  ignored=("*.rotary_emb.inv_freq",), at_most=("block_size",),
                  holds=holds)


QWEN2, QWEN3 = _qwen_arch("Qwen2"), _qwen_arch("Qwen3")
QWEN2_MOE, QWEN3_MOE = _qwen_arch("Qwen2-MoE"), _qwen_arch("Qwen3-MoE")
