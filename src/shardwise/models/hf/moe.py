"""Mixtures of experts stored one tensor per expert, and ``MixtralForCausalLM`` (``MIXTRAL``).

``_moe_tensor``: the tensor map of a Llama whose blocks hold a mixture of experts, shared
by Mixtral, the Qwen-MoEs (``models.hf.qwen``) and DeepSeek (``models.hf.deepseek``);
``_softmax_dropless``: the routing those archs but DeepSeek hold.

``MixtralForCausalLM`` (Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088;
transformers' ``models/mixtral/modeling_mixtral.py``): our Llama with ``n_experts``
(``models.moe``), softmax top-k routing renormalised, dropless; the checkpoint holds each
expert's three linears apart (``block_sparse_moe.experts.{e}.w1/w2/w3``, (out, in)), ours
stacks them (E, in, out).
"""

from __future__ import annotations

from collections.abc import Callable

from shardwise.models.hf.arch import (
    HFArch,
    HFTensor,
    _full_rotary,
    _plain,
    _refuse,
    _uniform,
    _window,
    fixes,
)
from shardwise.models.hf.llama import _llama_config_json, _llama_section, llama_hf_name


def _moe_tensor(moe: str, experts: dict[str, str], arch: str,
                shared: bool = False) -> Callable[[str], HFTensor]:
    """``HFArch.tensor`` of a Llama whose blocks hold a mixture of experts stored as on the
    Hub and as ``save_pretrained`` writes it (transformers 5 fuses the experts into 3-D
    ``mlp.experts.gate_up_proj`` / ``down_proj`` in memory only, its ``conversion_mapping``
    converting on load and back on save): Llama's names elsewhere; the router
    ``mlp.router.weight`` (E, C) is ``{moe}.gate.weight``; our stacked
    ``mlp.experts.gate_proj`` / ``up_proj`` (E, C, F) and ``down_proj`` (E, F, C) are E
    per-expert linears ``{moe}.experts.{e}.{experts[ours]}.weight`` ((F, C), (F, C) and
    (C, F)), e = 0..E-1. ``shared``: the arch has a gated shared expert (Qwen2-MoE), whose
    ``mlp.shared_expert.{gate,up,down}_proj.weight`` and ``mlp.shared_expert_gate.weight``
    (1, C) keep Llama's names; without it they are not this arch's."""
    def tensor(name: str) -> HFTensor:
        hf = llama_hf_name(name)
        layer, sep, rest = hf.partition(".mlp.")
        if not sep:
            return HFTensor(hf)
        if rest == "router.weight":
            return HFTensor(f"{layer}.{moe}.gate.weight")
        kind = rest.removeprefix("experts.")
        if kind in experts:
            return HFTensor(f"{layer}.{moe}.experts.{{}}.{experts[kind]}.weight",
                            transpose=True, stacked=True)
        if shared and rest.startswith(("shared_expert.", "shared_expert_gate.")):
            return HFTensor(hf)
        if rest in _DENSE_MLP:  # a dense block's SwiGLU (``dense_layers``): Llama's names
            return HFTensor(hf)
        raise KeyError(f"{name}: not a {arch} parameter name")
    return tensor


# a dense block's SwiGLU among the mixtures (``dense_layers``), under Llama's names
_DENSE_MLP = tuple(f"{k}_proj.weight" for k in ("gate", "up", "down"))


# Qwen2-MoE's and Qwen3-MoE's (Qwen2-MoE's conversion_mapping): mlp.gate and
# mlp.experts.{e}.gate_proj/...; Qwen2-MoE's shared expert and its gate under Llama's names
# (DeepSeek's experts too: models.hf.deepseek)
_QWEN_MOE_EXPERTS = {k: k for k in ("gate_proj", "up_proj", "down_proj")}


def _softmax_dropless(cfg) -> bool:
    """A Llama config's mixture routes by softmax, dropless (capacity factor 0), without a
    routing bias (``moe_bias_update_rate`` 0: no Hugging Face arch of ours has a tensor for
    it, and without it the experts chosen would differ), no group-limited routing, no
    routed scaling (DeepSeek's: not these archs')."""
    return (cfg.n_experts > 0 and cfg.moe_gating == "softmax" and cfg.moe_capacity_factor == 0
            and not getattr(cfg, "moe_bias_update_rate", 0.0)
            and not getattr(cfg, "moe_expert_bias", False)
            and getattr(cfg, "moe_n_group", 1) == 1
            and getattr(cfg, "moe_routed_scaling", 1.0) == 1.0)


# transformers' MixtralConfig defaults (configuration_mixtral.py), where they differ from the
# Llama's, for a config.json that leaves a field out
_MIXTRAL_DEFAULTS = {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
                     "rope_theta": 1e6, "num_key_value_heads": 8, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}
# our stacked expert weights -> Mixtral's per-expert linears (w1: gate, w2: down, w3: up)
_MIXTRAL_EXPERTS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def _mixtral_section(c: dict) -> dict:
    """A Mixtral is our Llama with ``n_experts`` (``models.moe``): routing as
    ``MixtralTopKRouter`` (softmax over all experts in fp32, top k, the k renormalised to
    sum to 1: ``moe.route`` with softmax gating and ``norm_topk``), dropless, no shared
    expert. Its ``sliding_window`` (MixtralConfig's default: none) is ours, on every
    layer; jitter noise on the router's input is refused."""
    c = {**_MIXTRAL_DEFAULTS, **{k: v for k, v in c.items() if v is not None}}
    jitter = float(c.get("router_jitter_noise") or 0.0)
    if jitter != 0.0:
        raise _refuse("Mixtral", f"router_jitter_noise={jitter} (shardwise's router takes "
                      "its input unperturbed: 0)")
    out = _llama_section(c, "Mixtral")
    out.update(_window(c.get("sliding_window")))
    width = c["intermediate_size"]
    out.update(ffn_hidden=width, moe_ffn_hidden=width, n_experts=c["num_local_experts"],
               top_k=c["num_experts_per_tok"], moe_gating="softmax", moe_norm_topk=True,
               moe_aux_loss_coef=float(c["router_aux_loss_coef"]), moe_capacity_factor=0.0,
               moe_shared_expert=False, moe_shared_ffn_hidden=0, moe_shared_expert_gate=False)
    return out


def _mixtral_config_json(cfg, source: dict | None) -> dict:
    out = _llama_config_json(cfg, source)
    for llama_only in ("attention_bias", "mlp_bias"):
        out.pop(llama_only, None)
    out.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
               intermediate_size=cfg.moe_ffn_hidden, num_local_experts=cfg.n_experts,
               num_experts_per_tok=cfg.top_k, router_aux_loss_coef=cfg.moe_aux_loss_coef,
               router_jitter_noise=0.0, sliding_window=cfg.sliding_window,
               output_router_logits=bool(out.get("output_router_logits", False)))
    return out


# Mixtral's block_sparse_moe: w1 the gate, w2 the down, w3 the up projection
_mixtral_tensor = _moe_tensor("block_sparse_moe", _MIXTRAL_EXPERTS, "Mixtral")


def mixtral_compatible(cfg) -> bool:
    """Whether a Llama config with ``n_experts`` is a Mixtral exactly: softmax gating with
    the top k renormalised, dropless (capacity factor 0), no shared expert, no routing bias
    (``moe_bias_update_rate`` 0: Mixtral has no tensor for it, and without it the experts
    chosen would differ), the mixture in every block (no ``dense_layers``), Llama's
    attention (no Q/K/V biases, no QK-norm, all of each head rotated), one window on every
    layer or none."""
    return (_softmax_dropless(cfg) and cfg.moe_norm_topk and not cfg.moe_shared_expert
            and not getattr(cfg, "dense_layers", ()) and fixes("Mixtral", cfg)
            and _uniform(cfg) and _full_rotary(cfg) and _plain(cfg))


MIXTRAL = HFArch(kind="llama", model_type="mixtral", architecture="MixtralForCausalLM",
                 section=_mixtral_section, config_json=_mixtral_config_json,
                 tensor=_mixtral_tensor, ignored=("*.rotary_emb.inv_freq",),
                 at_most=("block_size",), holds=mixtral_compatible)
