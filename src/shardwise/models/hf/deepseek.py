"""``DeepseekV3ForCausalLM`` and ``DeepseekV2ForCausalLM`` (``DEEPSEEK_V3``, ``DEEPSEEK_V2``;
DeepSeek-AI 2024, arXiv:2412.19437 and arXiv:2405.04434; transformers'
``models/deepseek_v3/modeling_deepseek_v3.py``, ``models/deepseek_v2/``).

Our Llama with multi-head latent attention (``models.mla``: ``kv_lora_rank`` and its head
widths) and DeepSeek's mixture (``models.moe``: its first blocks dense, shared experts as
one SwiGLU, V3's sigmoid gating with group-limited routing and the routing bias
``e_score_correction_bias``, V2's softmax), YaRN as ``models.llama.Yarn``; the experts
stored one tensor per expert as the Qwen-MoEs' (``models.hf.moe._moe_tensor``), the
multi-token-prediction layers ignored (``_mtp_layers``).
"""

from __future__ import annotations

from collections.abc import Callable

from shardwise.models.hf.arch import HFArch, HFConfigError, HFTensor, _get, _no_gemma, _refuse
from shardwise.models.hf.llama import _llama_config_json, _llama_section, llama_hf_name
from shardwise.models.hf.moe import _QWEN_MOE_EXPERTS, _moe_tensor

# transformers' DeepseekV3Config / DeepseekV2Config defaults (configuration_deepseek_v3.py /
# _v2.py) where a config.json may leave a field out
_DEEPSEEK_DEFAULTS = {
    "DeepSeek-V3": {"rms_norm_eps": 1e-6, "rope_interleave": True, "n_group": 8, "topk_group": 4,
                    "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                    "first_k_dense_replace": 3, "n_shared_experts": 1, "q_lora_rank": 1536},
    "DeepSeek-V2": {"rms_norm_eps": 1e-6, "n_group": None, "topk_group": None,
                    "topk_method": "greedy", "routed_scaling_factor": 1.0,
                    "first_k_dense_replace": 0, "n_shared_experts": None, "q_lora_rank": 1536}}
# the auxiliary loss weight when config.json names none (DeepSeek-V2's aux_loss_alpha)
_DEEPSEEK_AUX = 0.001


def _deepseek_section(c: dict, arch: str) -> dict:
    """A DeepSeek-V3 (arXiv:2412.19437; ``models/deepseek_v3/modeling_deepseek_v3.py``) or
    DeepSeek-V2 (arXiv:2405.04434; ``deepseek_v2``) is our Llama with multi-head latent
    attention (``kv_lora_rank``, ``q_lora_rank`` (null: a plain ``q_proj``),
    ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``; V3's ``rope_interleave``,
    V2's complex rotation, the same interleaved pairs), its first ``first_k_dense_replace``
    blocks dense (``dense_layers``, of ``intermediate_size``) and in the others
    ``n_routed_experts`` experts of ``moe_intermediate_size``, top ``num_experts_per_tok``,
    the gates times ``routed_scaling_factor``, and ``n_shared_experts`` shared experts as
    one SwiGLU of their summed width. V3: sigmoid gating, renormalised with
    ``norm_topk_prob``, groups (``n_group``, ``topk_group``) scored by their top 2 biased
    scores, the routing bias ``e_score_correction_bias`` (our ``expert_bias``,
    ``moe_expert_bias``: frozen unless the run sets ``moe_bias_update_rate``, the paper's
    0.001); V2: softmax, never renormalised
    (``DeepseekV2TopkRouter``), ``topk_method`` "greedy" or "group_limited_greedy" (groups
    scored by their best). YaRN (``rope_type = "yarn"``, every released DeepSeek's) is
    ``models.llama.Yarn``. Refused, naming the field: a rope type other than default and
    yarn, ``attention_bias``, an activation other than silu,
    ``num_key_value_heads`` other than the heads, no routed experts. Not read:
    ``num_nextn_predict_layers`` (multi-token prediction: transformers builds no such layer
    and ignores their tensors, ``_keys_to_ignore_on_load_unexpected``; so does shardwise:
    ``HFArch.ignored``)."""
    c = {**_DEEPSEEK_DEFAULTS[arch], **{k: v for k, v in c.items() if v is not None
                                        or k in ("q_lora_rank", "n_group", "topk_group",
                                                 "n_shared_experts")}}
    heads = c["num_attention_heads"]
    kv = _get(c, "num_key_value_heads", heads)
    if kv != heads:
        raise _refuse(arch, f"num_key_value_heads={kv!r} (MLA has one key and value per "
                      f"head: num_attention_heads={heads})")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    yarn = _deepseek_yarn(c, rope, arch) if kind == "yarn" else None
    if kind not in ("default", "yarn"):
        raise _refuse(arch, f"rope_type={kind!r} (shardwise's MLA has the default rotary "
                      "and YaRN)")
    if yarn is not None:  # the rest as the default rotary's, YaRN set below
        theta = float(rope.get("rope_theta", _get(c, "rope_theta", 10000.0)))
        c = {k: v for k, v in c.items() if k != "rope_scaling"}
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    experts = c.get("n_routed_experts")
    if not experts:
        raise _refuse(arch, f"n_routed_experts={experts!r} (shardwise loads DeepSeek with "
                      "routed experts)")
    out = _llama_section({**c, "num_key_value_heads": heads,
                          "head_dim": c["qk_nope_head_dim"] + c["qk_rope_head_dim"]}, arch)
    k = c["first_k_dense_replace"] or 0
    n_layer = c["num_hidden_layers"]
    if not 0 <= k < n_layer:
        raise _refuse(arch, f"first_k_dense_replace={k!r} (from 0 to num_hidden_layers - 1 "
                      f"= {n_layer - 1}: at least one layer with experts)")
    shared = c.get("n_shared_experts") or 0
    width = c["moe_intermediate_size"]
    v3 = arch == "DeepSeek-V3"
    groups = c.get("n_group") or 1
    if not v3 and c.get("topk_method", "greedy") == "greedy":
        groups = 1
    elif not v3 and c.get("topk_method") != "group_limited_greedy":
        raise _refuse(arch, f"topk_method={c.get('topk_method')!r} (DeepSeek-V2's are greedy "
                      "and group_limited_greedy)")
    out.update(head_dim=0, n_kv_heads=0, n_experts=experts, top_k=c["num_experts_per_tok"],
               moe_ffn_hidden=width, moe_gating="sigmoid" if v3 else "softmax",
               moe_norm_topk=bool(c.get("norm_topk_prob")) if v3 else False,
               moe_aux_loss_coef=float(_get(c, "aux_loss_alpha", _DEEPSEEK_AUX)),
               moe_capacity_factor=0.0, moe_shared_expert=shared > 0,
               moe_shared_ffn_hidden=shared * width, moe_shared_expert_gate=False,
               moe_expert_bias=v3,
               moe_n_group=groups, moe_topk_group=(c.get("topk_group") or 1) if groups > 1 else 1,
               moe_group_score="top2" if v3 else "top1",
               moe_routed_scaling=float(c["routed_scaling_factor"]),
               dense_layers=list(range(k)), kv_lora_rank=c["kv_lora_rank"],
               q_lora_rank=c.get("q_lora_rank") or 0,
               qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
               v_head_dim=c["v_head_dim"],
               rope_interleave=bool(c.get("rope_interleave", True)) if v3 else True)
    if yarn is not None:
        out["rope_scaling"] = yarn
    return out


def _deepseek_yarn(c: dict, rope: dict, arch: str) -> dict:
    """The ``models.llama.Yarn`` fields of a DeepSeek config.json's YaRN, as transformers'
    ``_compute_yarn_parameters`` reads them (``factor`` absent: max_position_embeddings /
    original_max_position_embeddings); ``truncate`` false refused."""
    if rope.get("truncate", True) is not True:
        raise _refuse(arch, f"rope truncate={rope.get('truncate')!r} (shardwise's YaRN "
                      "truncates the correction range, transformers' default)")
    original = rope.get("original_max_position_embeddings")
    if not original:
        raise HFConfigError("config.json: rope_type yarn without "
                            "original_max_position_embeddings")
    factor = rope.get("factor") or _get(c, "max_position_embeddings", 2048) / original
    out = {"rope_type": "yarn", "factor": float(factor),
           "original_max_position_embeddings": int(original)}
    for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
        if rope.get(k):  # transformers reads 0 / None as absent (``or`` defaults)
            out[k] = float(rope[k])
    return out


def _deepseek_config_json(cfg, source: dict | None, arch: str) -> dict:
    out = _llama_config_json(cfg, source)
    for other in ("mlp_bias", "head_dim", "pretraining_tp", "qk_head_dim"):
        out.pop(other, None)
    v3 = arch == "DeepSeek-V3"
    name = "DeepseekV3" if v3 else "DeepseekV2"
    width = cfg.moe_ffn_hidden
    out.update(architectures=[f"{name}ForCausalLM"], model_type=f"deepseek_{name[-2:].lower()}",
               num_key_value_heads=cfg.n_head,
               moe_intermediate_size=width, n_routed_experts=cfg.n_experts,
               num_experts_per_tok=cfg.top_k,
               n_shared_experts=cfg.moe_shared_ffn_hidden // width if cfg.moe_shared_expert
               else 0,
               routed_scaling_factor=cfg.moe_routed_scaling,
               n_group=cfg.moe_n_group, topk_group=cfg.moe_topk_group,
               first_k_dense_replace=len(cfg.dense_layers), kv_lora_rank=cfg.kv_lora_rank,
               q_lora_rank=cfg.q_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
               qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
               aux_loss_alpha=cfg.moe_aux_loss_coef)
    if v3:
        out.update(norm_topk_prob=cfg.moe_norm_topk, rope_interleave=cfg.rope_interleave)
    else:
        out.update(topk_method="group_limited_greedy" if cfg.moe_n_group > 1 else "greedy",
                   norm_topk_prob=False)
    return out


def _deepseek_tensor(arch: str) -> Callable[[str], HFTensor]:
    """Llama's names (MLA's ``self_attn.*`` are transformers' own); the router, the experts
    and the dense blocks' MLP as Qwen-MoE's (``_moe_tensor``); our ``mlp.shared_expert.*``
    is ``mlp.shared_experts.*``; our routing bias ``mlp.expert_bias`` (E,) is V3's
    ``mlp.gate.e_score_correction_bias``."""
    moe = _moe_tensor("mlp", _QWEN_MOE_EXPERTS, arch)

    def tensor(name: str) -> HFTensor:
        layer, sep, rest = llama_hf_name(name).partition(".mlp.")
        if sep and rest.startswith("shared_expert."):
            return HFTensor(f"{layer}.mlp.shared_experts.{rest.removeprefix('shared_expert.')}")
        if sep and rest == "expert_bias" and arch == "DeepSeek-V3":
            return HFTensor(f"{layer}.mlp.gate.e_score_correction_bias")
        return moe(name)
    return tensor


def deepseek_compatible(cfg, arch: str = "DeepSeek-V3") -> bool:
    """Whether a Llama config is a DeepSeek-V3 (or V2) exactly: MLA (``kv_lora_rank``),
    experts, its dense blocks the first ones, dropless, no shared-expert gate, every block
    windowless; V3: sigmoid gating, groups scored by their top 2 (or none); V2: softmax
    without renormalisation, no routing bias, groups scored by their best (or none)."""
    if not (getattr(cfg, "kv_lora_rank", 0) and cfg.n_experts and cfg.moe_capacity_factor == 0
            and not cfg.moe_shared_expert_gate and _no_gemma(cfg)
            and tuple(cfg.dense_layers) == tuple(range(len(cfg.dense_layers)))):
        return False
    if cfg.moe_shared_expert and cfg.moe_shared_ffn_hidden % cfg.moe_ffn_hidden:
        return False
    grouped = cfg.moe_n_group > 1
    if arch == "DeepSeek-V3":
        return cfg.moe_gating == "sigmoid" and (not grouped or cfg.moe_group_score == "top2")
    return (cfg.moe_gating == "softmax" and not cfg.moe_norm_topk
            and not cfg.moe_bias_update_rate and not cfg.moe_expert_bias and cfg.rope_interleave
            and (not grouped or cfg.moe_group_score == "top1"))


def _deepseek_arch(arch: str) -> HFArch:
    v = arch[-2:]
    return HFArch(kind="llama", model_type=f"deepseek_{v.lower()}",
                  architecture=f"Deepseek{v}ForCausalLM",
                  section=lambda c: _deepseek_section(c, arch),
                  config_json=lambda cfg, source: _deepseek_config_json(cfg, source, arch),
                  tensor=_deepseek_tensor(arch),
                  ignored=("*.rotary_emb.inv_freq",), ignores=_mtp_layers,
                  at_most=("block_size",), holds=lambda cfg: deepseek_compatible(cfg, arch))


def _mtp_layers(cfg) -> tuple[str, ...]:
    """The multi-token-prediction layers a DeepSeek checkpoint may hold after its
    ``num_hidden_layers`` (V3: one; transformers ignores them): the next 8 layer numbers."""
    return tuple(f"model.layers.{cfg.n_layer + i}.*" for i in range(8))


DEEPSEEK_V3, DEEPSEEK_V2 = _deepseek_arch("DeepSeek-V3"), _deepseek_arch("DeepSeek-V2")
