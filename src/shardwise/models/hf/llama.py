"""``LlamaForCausalLM`` and ``MistralForCausalLM`` (``LLAMA``, ``MISTRAL``), and the Llama
every Llama-family arch builds on: its rotary tables (``_rope_table``, ``rope_parameters``),
its ``[model]`` section and config.json (``_llama_section``, ``_llama_config_json``), its
tensor names (``LLAMA_PREFIXES``, ``llama_hf_name``).

``LlamaForCausalLM``: our names map 1:1 (``models.llama.hf_name``), and both use the
"rotate_half" rotary layout, so no weight is permuted. ``MistralForCausalLM`` (Jiang et al.
2023, arXiv:2310.06825; ``models/mistral/modeling_mistral.py``: Mistral-7B, Mistral-Nemo,
Ministral) is the same Llama under ``MistralConfig``'s defaults, its ``sliding_window`` our
``sliding_window`` on every layer (Mixtral's too); a dense Llama config without a window is
both, so ``arch_for`` says Llama and ``export_arch`` Mistral when the run's source was one,
and with a window on every layer it is a Mistral (a ``LlamaForCausalLM`` has no window).
"""

from __future__ import annotations

from shardwise.models.hf.arch import (
    _NO_WINDOW,
    HFArch,
    HFConfigError,
    HFTensor,
    _dense,
    _get,
    _long_rope,
    _refuse,
    _uniform,
    _whole_window,
    _window,
    _windowless,
    options,
)


def _llama_rope(c: dict, arch: str = "Llama") -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling fields or None) of a config.json: transformers 5's
    ``rope_parameters`` or the older ``rope_theta`` / ``rope_scaling``."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    return _rope_table(rope, float(_get(c, "rope_theta", 10000.0)), arch)


def _rope_table(rope: dict, theta: float, arch: str, where: str = "rope_type"
                ) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling fields or None) of one rotary table of a config.json
    (``theta`` where it names none): the default rotary, Llama 3's scaling or the linear
    one (``models.llama.LinearRope``); another ``rope_type`` refused, naming it as
    ``where``."""
    theta = float(rope.get("rope_theta", theta))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        if "factor" not in rope:
            raise HFConfigError("config.json: rope_type linear without factor")
        return theta, {"rope_type": "linear", "factor": float(rope["factor"])}
    if kind != "llama3":
        raise _refuse(arch, f"{where}={kind!r} (shardwise has default, linear and llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in rope]
    if missing:
        raise HFConfigError(f"config.json: rope_type llama3 without {missing[0]}")
    return theta, {k: rope[k] for k in keys}


def _rotary_dim(c: dict, head_dim: int, arch: str, partial: bool) -> int:
    """The rotated features R of each head: ``head_dim x partial_rotary_factor`` truncated,
    as transformers (``rope_parameters``' factor, else the top-level one older config.json
    files carry, else 1). ``partial``: the arch rotates part of a head (Phi-3); else a
    factor other than 1 is refused."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    factor = rope.get("partial_rotary_factor", _get(c, "partial_rotary_factor", 1.0))
    if factor == 1:
        return head_dim
    if not partial:
        raise _refuse(arch, f"partial_rotary_factor={factor!r} ({arch} rotates all of each "
                      "head: 1.0)")
    ok = isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor < 1
    r = int(head_dim * factor) if ok else 0
    if r < 2 or r % 2:
        raise HFConfigError(f"config.json: partial_rotary_factor={factor!r}: expected a "
                            f"factor in (0, 1] rotating an even number >= 2 of head_dim="
                            f"{head_dim} features")
    return r


def _llama_section(c: dict, arch: str = "Llama", partial: bool = False) -> dict:
    """``partial``: the arch may rotate part of each head (``_rotary_dim``: Phi-3's
    ``partial_rotary_factor``)."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if _get(c, key, want) != want:
            raise _refuse(arch, f"{key}={c[key]!r} (shardwise's is {want!r})")
    head_dim = _get(c, "head_dim", h // heads)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise HFConfigError(f"config.json: head_dim={head_dim!r}: expected an even whole "
                            "number >= 2")
    theta, scaling = _llama_rope(c, arch)
    rotary = _rotary_dim(c, head_dim, arch, partial)
    return dict(kind="llama", vocab_size=c["vocab_size"], n_embd=h,
                n_layer=c["num_hidden_layers"], n_head=heads,
                n_kv_heads=_get(c, "num_key_value_heads", heads),
                ffn_hidden=c["intermediate_size"],
                block_size=_get(c, "max_position_embeddings", 2048),
                norm_eps=float(_get(c, "rms_norm_eps", 1e-6)), rope_theta=theta,
                rope_scaling=scaling, tie_weights=bool(_get(c, "tie_word_embeddings", False)),
                n_experts=0, **options("Llama"), dense_layers=[], **_NO_WINDOW,
                # 0: n_embd / n_head, so a run need not name it
                head_dim=0 if h % heads == 0 and head_dim == h // heads else head_dim,
                rotary_dim=0 if rotary == head_dim else rotary)  # 0: all of head_dim


def rope_parameters(cfg) -> dict:
    """``transformers``' ``rope_parameters`` of a ``LlamaConfig``: the default rotary base,
    Llama 3's frequency scaling (``rope_type = "llama3"``), the linear one (``"linear"``)
    or LongRoPE (``"longrope"``, its attention factor written out, so that it keeps its
    value whatever the context)."""
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    rs = cfg.rope_scaling
    if getattr(rs, "beta_fast", None) is not None:  # YaRN (models.llama.Yarn: DeepSeek's)
        keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                "mscale", "mscale_all_dim", "attention_factor")
        return {"rope_type": "yarn", "rope_theta": cfg.rope_theta,
                **{k: getattr(rs, k) for k in keys if getattr(rs, k) is not None}}
    if not hasattr(rs, "low_freq_factor") and not _long_rope(cfg):  # models.llama.LinearRope
        return {"rope_type": "linear", "rope_theta": cfg.rope_theta, "factor": rs.factor}
    if _long_rope(cfg):
        return {"rope_type": "longrope", "rope_theta": cfg.rope_theta,
                "short_factor": list(rs.short_factor), "long_factor": list(rs.long_factor),
                "original_max_position_embeddings": rs.original_max_position_embeddings,
                "attention_factor": rs.attention_factor}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor, "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings}


def _llama_config_json(cfg, source: dict | None) -> dict:
    out = dict(source or {"bos_token_id": None, "eos_token_id": None})
    for legacy in ("rope_scaling", "rope_theta", "_name_or_path", "torch_dtype"):
        out.pop(legacy, None)
    rope = rope_parameters(cfg)
    out.update(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=cfg.vocab_size,
        hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
        # a run may train on shorter windows than the checkpoint's context: keep its context
        max_position_embeddings=max(cfg.block_size,
                                    int(out.get("max_position_embeddings") or 0)),
        rms_norm_eps=cfg.norm_eps, rope_parameters=rope,
        tie_word_embeddings=cfg.tie_weights, attention_bias=False, mlp_bias=False,
        attention_dropout=cfg.dropout, dtype="float32")
    return out


# our prefix -> Hugging Face's (``models.llama.hf_name``); inside a block the names are HF's
LLAMA_PREFIXES = (("embed.tok.", "model.embed_tokens."), ("blocks.", "model.layers."),
                  ("head.norm.", "model.norm."), ("head.proj.", "lm_head."))


def llama_hf_name(name: str) -> str:
    """Our Llama parameter name -> ``LlamaForCausalLM``'s (``blocks.3.mlp.up_proj.weight`` ->
    ``model.layers.3.mlp.up_proj.weight``). Raises ``KeyError`` for a name it does not know."""
    for ours, theirs in LLAMA_PREFIXES:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    raise KeyError(f"{name}: not a Llama parameter name")


def _llama_tensor(name: str) -> HFTensor:
    return HFTensor(llama_hf_name(name))


LLAMA = HFArch(kind="llama", model_type="llama", architecture="LlamaForCausalLM",
               section=_llama_section, config_json=_llama_config_json, tensor=_llama_tensor,
               ignored=("*.rotary_emb.inv_freq",), at_most=("block_size",),
               holds=_dense("Llama", windows=_windowless))


# transformers' MistralConfig defaults (configuration_mistral.py), where they differ from the
# Llama's, for a config.json that leaves a field out (rope_theta and rms_norm_eps are the
# Llama's: 10000 and 1e-6)
_MISTRAL_DEFAULTS = {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8}
# MistralConfig's sliding_window when config.json leaves it out (Mistral-7B-v0.1's); null
# (v0.2 on, Mistral-Nemo) is no window
_MISTRAL_WINDOW = 4096


def _mistral_window(c: dict) -> int | None:
    """The sliding window W of a Mistral config.json (on every layer), else None: its
    ``sliding_window``, 4096 when the field is absent (``MistralConfig``'s default), none
    when it is null."""
    window = c.get("sliding_window", _MISTRAL_WINDOW)
    return None if window is None else _whole_window(window)


def _mistral_section(c: dict) -> dict:
    """A Mistral (Jiang et al. 2023, "Mistral 7B", arXiv:2310.06825;
    ``models/mistral/modeling_mistral.py``) is our Llama: the same tensors, names and
    rotary layout, ``MistralConfig``'s defaults where config.json is silent, its
    ``head_dim`` when it is not hidden / heads (Mistral-Nemo: 5120 wide, 32 heads of 128).
    ``attention_bias`` / ``mlp_bias`` are not Mistral's (``MistralAttention`` and
    ``MistralMLP`` have no biases, whatever config.json says): not read. Its sliding window
    W (``_mistral_window``) is ours, on every layer."""
    window = _mistral_window(c)
    c = {**_MISTRAL_DEFAULTS, **{k: v for k, v in c.items()
                                 if v is not None and k not in ("attention_bias", "mlp_bias")}}
    out = _llama_section(c, "Mistral")
    out.update(_window(window))
    return out


def _mistral_config_json(cfg, source: dict | None) -> dict:
    """Llama's config.json under Mistral's names, the model's window (``sliding_window``,
    null for none); the source's context as it was (``MistralConfig``'s defaults written
    out where the source left them out, so they keep their meaning)."""
    if source is not None:
        source = {**_MISTRAL_DEFAULTS, **source}
    out = _llama_config_json(cfg, source)
    for llama_only in ("attention_bias", "mlp_bias", "pretraining_tp"):
        out.pop(llama_only, None)
    out.update(architectures=["MistralForCausalLM"], model_type="mistral",
               sliding_window=cfg.sliding_window)
    return out


# a dense Llama is a Mistral too: arch_for says Llama (Mistral with a window: a Llama has none),
# export_arch Mistral for a Mistral's run
MISTRAL = HFArch(kind="llama", model_type="mistral", architecture="MistralForCausalLM",
                 section=_mistral_section, config_json=_mistral_config_json,
                 tensor=_llama_tensor, ignored=("*.rotary_emb.inv_freq",),
                 at_most=("block_size",),
                 holds=_dense("Mistral", windows=_uniform))
