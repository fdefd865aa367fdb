"""``Phi3ForCausalLM`` (``PHI3``: Phi-3 mini / medium, Phi-4, Phi-4-mini; Abdin et al. 2024,
"Phi-3 Technical Report", arXiv:2404.14219; ``models/phi3/modeling_phi3.py``).

Our Llama, with only the first ``rotary_dim`` features of a head rotated when
``partial_rotary_factor`` < 1, its ``sliding_window`` ours on every layer as Mistral's
(Phi-3-mini-4k: 2047), and LongRoPE in its short regime (``block_size`` at most
``original_max_position_embeddings``: ``HFArch.bound_reason``); on disk its Q, K, V are the
rows of one ``self_attn.qkv_proj`` ((H + 2 Hkv) D, h) and gate and up the halves of one
``mlp.gate_up_proj`` (2F, h), pieces of unequal sizes (``HFTensor.sizes``) whose offsets
depend on the head counts, so its tensor map is made for a config (``HFArch.of``); a
checkpoint is read with its own arch (``export_arch``), since a Llama config does not say
Phi-3.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from shardwise.models.hf.arch import (
    HFArch,
    HFConfigError,
    HFTensor,
    _get,
    _long_rope,
    _plain,
    _refuse,
    _uniform,
    _window,
    fixes,
)
from shardwise.models.hf.llama import (
    _llama_config_json,
    _llama_section,
    _mistral_window,
    llama_hf_name,
)

# transformers' Phi3Config defaults (configuration_phi3.py), where they differ from the Llama's,
# for a config.json that leaves a field out (num_key_value_heads: num_attention_heads, as the
# Llama's; sliding_window: none, unlike Mistral's)
_PHI3_DEFAULTS = {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                  "original_max_position_embeddings": 4096}
# Phi3ForCausalLM's packed linears: our module -> (theirs, which piece); Q, K, V are rows of
# qkv_proj in that order, gate and up of gate_up_proj (Phi3MLP: ``gate, up_states =
# gate_up_proj(x).chunk(2, dim=-1)``)
_PHI3_PACKED = {"self_attn.q_proj": ("self_attn.qkv_proj", 0),
                "self_attn.k_proj": ("self_attn.qkv_proj", 1),
                "self_attn.v_proj": ("self_attn.qkv_proj", 2),
                "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1)}


def _phi3_window(c: dict) -> int | None:
    """The sliding window W of a Phi-3 config.json (on every layer), else None: Mistral's
    (``_mistral_window``) but none when the field is absent (``Phi3Config``'s default;
    Phi-3-mini-4k: 2047, Phi-4: null)."""
    return _mistral_window({"sliding_window": None, **c})


def _phi3_long_rope(c: dict) -> dict | None:
    """The ``LongRope`` fields (``models.llama``) of a Phi-3 config.json with LongRoPE
    (``rope_type`` "longrope": Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini), as
    ``Phi3Config`` and ``_compute_longrope_parameters`` read them, else None (the default
    rotary). ``original_max_position_embeddings``: the top-level field (``Phi3Config``
    puts it over the rope table's; 4096 when absent); ``attention_factor``: the table's,
    else from ``factor`` (the table's, else ``max_position_embeddings / original``): 1 up
    to 1, else ``sqrt(1 + ln factor / ln original)``. Refused: another rope type, and the
    older names "su" / "yarn", which transformers 5 renames but then fails to load."""
    c = {**_PHI3_DEFAULTS, **{k: v for k, v in c.items() if v is not None}}
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "longrope":
        raise _refuse("Phi-3", f"rope_type={kind!r} (Phi-3's are 'default' and 'longrope'; "
                      "for the older 'su' / 'yarn', write 'longrope')")
    missing = [k for k in ("short_factor", "long_factor") if not rope.get(k)]
    if missing:
        raise HFConfigError(f"config.json: rope_type longrope without {missing[0]}")
    original = c["original_max_position_embeddings"]
    factor = rope.get("factor")
    factor = c["max_position_embeddings"] / original if factor is None else factor
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": [float(x) for x in rope["short_factor"]],
            "long_factor": [float(x) for x in rope["long_factor"]],
            "original_max_position_embeddings": original, "attention_factor": float(attention)}


def _phi3_bound(c: dict) -> dict[str, str]:
    """``HFArch.bound_reason`` of Phi-3: LongRoPE's, when its original length
    (``original_max_position_embeddings``) is shorter than the context: beyond it
    transformers switches to the long factors, which shardwise does not have."""
    try:
        long = _phi3_long_rope(c)
    except HFConfigError:
        return {}
    if long is None:
        return {}
    original = long["original_max_position_embeddings"]
    context = _get(c, "max_position_embeddings", _PHI3_DEFAULTS["max_position_embeddings"])
    if original >= context:
        return {}
    return {"block_size": "its LongRoPE: shardwise has the short factors only, which "
                          f"transformers uses up to {original} tokens "
                          "(original_max_position_embeddings)"}


def _phi3_section(c: dict) -> dict:
    """A Phi-3 or Phi-4 (Abdin et al. 2024, "Phi-3 Technical Report", arXiv:2404.14219;
    ``models/phi3/modeling_phi3.py``) is our Llama: RMSNorm, SwiGLU, grouped-query
    attention, the "rotate_half" rotary layout, its Q/K/V and gate/up linears packed on disk
    (``tensor``); ``Phi3Config``'s defaults where config.json is silent; the rotary base
    from ``rope_parameters`` or the older top-level ``rope_theta``; only the first
    ``head_dim x partial_rotary_factor`` features of a head rotated (``rotary_dim``;
    Phi-4-mini: 0.75). Its sliding window W (``_phi3_window``) is ours, on every layer, as
    Mistral's. LongRoPE (``_phi3_long_rope``) becomes ``rope_scaling``
    (``models.llama.LongRope``) and bounds ``block_size`` by
    ``original_max_position_embeddings`` (``_phi3_bound``): beyond it transformers
    switches to the long factors, which shardwise does not. Not read: ``resid_pdrop``,
    ``embd_pdrop``, ``attention_dropout`` (training regularisers: a run's dropout is its
    ``model.dropout``, on the attention probabilities as ``attention_dropout``);
    ``attention_bias`` / ``mlp_bias`` (Phi-3's linears have none)."""
    window = _phi3_window(c)
    long = _phi3_long_rope(c)
    c = {**_PHI3_DEFAULTS, **{k: v for k, v in c.items()
                              if v is not None and k not in ("attention_bias", "mlp_bias")}}
    if long is not None:  # the rest of the rope table as the default rotary's
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        c = {k: v for k, v in c.items() if k != "rope_scaling"}
        c["rope_parameters"] = {k: rope[k] for k in ("rope_theta", "partial_rotary_factor")
                                if k in rope}
    out = _llama_section(c, "Phi-3", partial=True)
    out.update(_window(window))
    if long is not None:
        half = (out["rotary_dim"] or out["head_dim"] or out["n_embd"] // out["n_head"]) // 2
        bad = [k for k in ("short_factor", "long_factor") if len(long[k]) != half]
        if bad:
            raise HFConfigError(f"config.json: rope_parameters.{bad[0]} has "
                                f"{len(long[bad[0]])} factors, expected {half} (one per "
                                "rotary frequency)")
        out["rope_scaling"] = long
        out["block_size"] = min(out["block_size"], long["original_max_position_embeddings"])
    return out


def _rotary_factor(rotary: int, head_dim: int) -> float:
    """``partial_rotary_factor`` such that transformers' ``int(head_dim * factor)`` is
    ``rotary`` (``rotary / head_dim`` itself may land a hair below: 30 / 44 * 44 < 30)."""
    factor = rotary / head_dim
    while int(head_dim * factor) < rotary:
        factor = math.nextafter(factor, 2.0)
    return factor


def _phi3_config_json(cfg, source: dict | None) -> dict:
    """Llama's config.json under Phi-3's names: ``partial_rotary_factor`` in
    ``rope_parameters``; the model's window (``sliding_window``, null for none); the
    source's context, ``original_max_position_embeddings`` and residual / embedding dropout
    as they were (``Phi3Config``'s defaults written out where the source left them out);
    no source: no padding token."""
    if source is not None:
        source = {**_PHI3_DEFAULTS, **source}
    out = _llama_config_json(cfg, source)
    for other in ("attention_bias", "mlp_bias", "pretraining_tp", "partial_rotary_factor"):
        out.pop(other, None)
    out["rope_parameters"]["partial_rotary_factor"] = _rotary_factor(
        cfg.rotary_dim or cfg.head_dim, cfg.head_dim)
    if _long_rope(cfg):  # Phi3Config takes the top-level original over the table's
        out["original_max_position_embeddings"] = \
            cfg.rope_scaling.original_max_position_embeddings
    out.setdefault("pad_token_id", None)  # Phi3Config's 32000 is past a small vocabulary
    out.update(architectures=["Phi3ForCausalLM"], model_type="phi3",
               original_max_position_embeddings=out.get("original_max_position_embeddings",
                                                         out["max_position_embeddings"]),
               sliding_window=cfg.sliding_window,
               resid_pdrop=out.get("resid_pdrop", 0.0), embd_pdrop=out.get("embd_pdrop", 0.0))
    return out


def _phi3_tensor(cfg) -> Callable[[str], HFTensor]:
    """``HFArch.tensor`` of Phi-3 for the Llama config ``cfg``: Llama's names, but our
    ``self_attn.q_proj`` / ``k_proj`` / ``v_proj`` (H D, h), (Hkv D, h), (Hkv D, h) are the
    rows of ``self_attn.qkv_proj.weight`` ((H + 2 Hkv) D, h) in that order, and
    ``mlp.gate_proj`` / ``up_proj`` (F, h) the two halves of ``mlp.gate_up_proj.weight``
    (2F, h), gate first (``Phi3Attention`` / ``Phi3MLP``)."""
    heads = (cfg.n_head, cfg.n_kv_heads, cfg.n_kv_heads)

    def tensor(name: str) -> HFTensor:
        layer, _, inner = name.removeprefix("blocks.").partition(".")
        module, _, kind = inner.rpartition(".")
        if not name.startswith("blocks.") or module not in _PHI3_PACKED:
            return HFTensor(llama_hf_name(name))
        packed, i = _PHI3_PACKED[module]
        qkv = packed == "self_attn.qkv_proj"
        return HFTensor(f"model.layers.{layer}.{packed}.{kind}", part=(i, 3 if qkv else 2),
                        sizes=heads if qkv else None)
    return tensor


def _phi3_unsized(name: str) -> HFTensor:
    raise ValueError(f"{name}: Phi-3's packed qkv_proj depends on the head counts; use "
                     "models.hf.PHI3.of(config)")


# Phi-3 / Phi-4: a dense Llama with Llama's attention, any rotary_dim, no Llama 3 scaling, one
# window on every layer or none (Mistral's); arch_for says Llama or Mistral for a Llama that
# rotates all of each head without LongRoPE, Phi-3 for one that does not
PHI3 = HFArch(kind="llama", model_type="phi3", architecture="Phi3ForCausalLM",
              section=_phi3_section, config_json=_phi3_config_json, tensor=_phi3_unsized,
              ignored=("*.rotary_emb.inv_freq",), at_most=("block_size",),
              bound_reason=_phi3_bound,
              holds=lambda cfg: (not cfg.n_experts and fixes("Phi3", cfg) and _uniform(cfg)
                                 and (cfg.rope_scaling is None or _long_rope(cfg))
                                 and _plain(cfg)),
              sized=_phi3_tensor)
