"""``GemmaForCausalLM``, ``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM`` (``GEMMA``,
``GEMMA2``, ``GEMMA3``), and the multimodal ``Gemma3ForConditionalGeneration``'s language
model (``GEMMA3_VLM``).

Gemma Team 2024, arXiv:2403.08295, arXiv:2408.00118, arXiv:2503.19786; transformers'
``models/gemma*/modeling_gemma*.py`` (Gemma 3's text model: ``gemma3_text``). Our Llama with
Gemma's options (``models.llama``: zero-centred norms, the embedding's sqrt(h), GeGLU; Gemma
2 and 3 the sandwich norms, their ``query_pre_attn_scalar`` and ``layer_types`` windows;
Gemma 2 its soft caps; Gemma 3 QK-norm, the logits' soft cap when set and the local rotary
base), Llama's tensor names (their ``post_attention_layernorm`` is the attention output's
norm, ours too with ``sandwich_norm``), tied heads by default. The multimodal
``Gemma3ForConditionalGeneration`` (``model_type`` "gemma3": Gemma 3 4B, 12B and 27B) is
read for its language model only (``GEMMA3_VLM``, ``HFArch.language_model``): its
``text_config`` under ``Gemma3TextConfig``'s defaults, its text tensors under either of the
names they are saved with (``HFArch.layouts``, ``HFArch.reading``), the vision tower and the
projector ignored (never read); an export of such a run writes that language model as a
text-only ``Gemma3ForCausalLM`` (``models.hf.text_source``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from shardwise.models.hf.arch import (
    _ATTENTION_TYPES,
    _LAYER_TYPE,
    SOFT_CAPS,
    HFArch,
    HFConfigError,
    HFTensor,
    _full_rotary,
    _get,
    _refuse,
    _window,
    _windowless,
    fixes,
    options,
)
from shardwise.models.hf.llama import _llama_config_json, _llama_section, _llama_tensor, _rope_table

# transformers' GemmaConfig / Gemma2Config / Gemma3TextConfig defaults (configuration_gemma*.py),
# where they differ from the Llama's, for a config.json that leaves a field out; the soft caps'
# and the window's null is a value (none), so absent and null differ there
_GEMMA_DEFAULTS = {
    "Gemma": {"max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "head_dim": 256,
              "num_key_value_heads": 16, "tie_word_embeddings": True,
              "hidden_act": "gelu_pytorch_tanh"},
    "Gemma2": {"max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "head_dim": 256,
               "num_key_value_heads": 4, "tie_word_embeddings": True,
               "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
               "sliding_window": 4096, **SOFT_CAPS["Gemma2"]},
    "Gemma3": {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
               "num_hidden_layers": 26, "num_attention_heads": 8,
               "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "head_dim": 256,
               "num_key_value_heads": 4, "tie_word_embeddings": True,
               "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
               "sliding_window": 4096, **SOFT_CAPS["Gemma3"],
               "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
               "rope_local_base_freq": 10_000.0}}
# the soft caps a Gemma 2 or 3 config.json holds (null: none)
_CAPS = tuple(SOFT_CAPS["Gemma2"])
# the activation field of each (GemmaConfig's hidden_act; Gemma 2/3: hidden_activation) and
# the names of the tanh GELU it may hold (GemmaConfig turns the released "gelu" into it)
_GEMMA_ACT = {"Gemma": ("hidden_act", ("gelu_pytorch_tanh", "gelu")),
              "Gemma2": ("hidden_activation", ("gelu_pytorch_tanh",)),
              "Gemma3": ("hidden_activation", ("gelu_pytorch_tanh",))}


def _gemma_defaults(c: dict, arch: str) -> dict:
    nullable = (*_CAPS, "sliding_window")
    return {**_GEMMA_DEFAULTS[arch],
            **{k: v for k, v in c.items() if v is not None or k in nullable}}


def _gemma3_rope(c: dict) -> dict:
    """The [model] rotary fields of a Gemma 3 config.json, as ``Gemma3TextConfig`` reads
    them: transformers 5's ``rope_parameters`` keyed by layer type ("full_attention":
    ``rope_theta`` and ``rope_scaling``, Gemma 3 4B/12B/27B's linear factor 8;
    "sliding_attention": ``rope_local_base_freq``), or the older form, ``rope_theta``
    (default 1e6), ``rope_local_base_freq`` (1e4) and ``rope_scaling`` (the global
    layers'). A scaled rotary on the sliding layers is refused (ours take the default)."""
    rp = c.get("rope_parameters") or {}
    if "full_attention" in rp or "sliding_attention" in rp:
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    else:
        full, local = c.get("rope_scaling") or rp, {}
    theta, scaling = _rope_table(full, c["rope_theta"], "Gemma3",
                                 "rope_parameters.full_attention.rope_type")
    local_theta, local_scaling = _rope_table(local, c["rope_local_base_freq"], "Gemma3",
                                             "rope_parameters.sliding_attention.rope_type")
    if local_scaling is not None:
        raise _refuse("Gemma3", "rope_parameters.sliding_attention.rope_type="
                      f"{local_scaling['rope_type']!r} (shardwise's sliding layers take the "
                      "default rotary)")
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_base_freq": local_theta}


def _gemma_section(c: dict, arch: str) -> dict:
    """A Gemma (``arch`` "Gemma", "Gemma2" or "Gemma3": Gemma Team 2024, arXiv:2403.08295,
    arXiv:2408.00118, arXiv:2503.19786; transformers' ``models/gemma*/``) is our Llama with
    zero-centred RMSNorms, the embedding scaled by sqrt(h), GeGLU (the tanh GELU) and its
    ``head_dim`` (default 256); Gemma 2 and 3 add the sandwich norms, the scores scaled by
    ``query_pre_attn_scalar ** -0.5`` and windows on the layers ``layer_types`` marks
    "sliding_attention" (default: every other one from layer 0, Gemma 3's five of every
    six, ``sliding_window_pattern``); Gemma 2 soft-caps the scores and the logits
    (defaults 50 and 30; null: none), Gemma 3 the logits only (its attention takes no cap,
    as transformers': not read) and has QK-norm and its local rotary (``_gemma3_rope``):
    the options each fixes are its ``OPTIONS``, the caps it reads its ``SOFT_CAPS``.
    Refused: ``use_bidirectional_attention``, another activation, ``attention_bias``, a
    null ``sliding_window`` with sliding layers."""
    c = _gemma_defaults(c, arch)
    if c.get("use_bidirectional_attention"):
        raise _refuse(arch, f"use_bidirectional_attention={c['use_bidirectional_attention']!r} "
                      "(shardwise's attention is causal: false)")
    key, tanh = _GEMMA_ACT[arch]
    if c.get(key) not in tanh:
        raise _refuse(arch, f"{key}={c.get(key)!r} (shardwise's {arch} has "
                      "gelu_pytorch_tanh)")
    out = _llama_section({k: v for k, v in c.items() if k not in ("hidden_act", "mlp_bias")},
                         arch)
    head_dim = out["head_dim"] or out["n_embd"] // out["n_head"]
    out.update(mlp_activation="gelu_tanh", query_pre_attn_scalar=0.0, **options("Gemma"))
    if arch == "Gemma":
        return out
    scalar = c["query_pre_attn_scalar"]
    types = c.get("layer_types") or [
        "full_attention" if (i + 1) % (2 if arch == "Gemma2" else c["sliding_window_pattern"])
        == 0 else "sliding_attention" for i in range(out["n_layer"])]
    bad = [t for t in types if t not in _ATTENTION_TYPES]
    if bad:
        raise _refuse(arch, f"layer_types has {bad[0]!r} (expected "
                      f"{' or '.join(_ATTENTION_TYPES)})")
    if c.get("sliding_window") is None and "sliding_attention" in types:
        raise _refuse(arch, "sliding_window=null with sliding_attention layers")
    out.update(_window(c["sliding_window"], types))
    out.update(options(arch),
               query_pre_attn_scalar=0.0 if scalar == head_dim else float(scalar),
               **{cap: float(c[cap] or 0.0) for cap in SOFT_CAPS[arch]})
    if arch == "Gemma2":
        return out
    out.update(_gemma3_rope(c))
    return out


def _gemma_config_json(cfg, source: dict | None, arch: str) -> dict:
    """Llama's config.json under Gemma's names (``arch`` "Gemma", "Gemma2", "Gemma3"): the
    tanh GELU, ``query_pre_attn_scalar`` (head_dim's when the model has none), the soft caps
    (null: none), the window on the layers of ``layer_types`` (all "full_attention"
    without one, ``sliding_window`` then the source's, unused), Gemma 3's
    ``rope_parameters`` keyed by layer type (the sliding layers' ``rope_local_base_freq``,
    or the global rotary when the model has none); no bidirectional attention."""
    if source is not None:
        source = {k: v for k, v in source.items()
                  if k not in ("rope_local_base_freq", "sliding_window_pattern")}
    out = _llama_config_json(cfg, source)
    for other in ("mlp_bias", "pretraining_tp", "hidden_act", "hidden_activation"):
        out.pop(other, None)
    model_type = {"Gemma": "gemma", "Gemma2": "gemma2", "Gemma3": "gemma3_text"}[arch]
    act = "hidden_act" if arch == "Gemma" else "hidden_activation"
    out.update({"architectures": [f"{arch}ForCausalLM"], "model_type": model_type,
                act: "gelu_pytorch_tanh", "use_bidirectional_attention": False})
    if arch == "Gemma":
        return out
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim  # Gemma2Config's is an int
    out.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
               **{cap: getattr(cfg, cap) for cap in _CAPS},
               sliding_window=(out.get("sliding_window") or _GEMMA_DEFAULTS[arch]
                               ["sliding_window"]) if _windowless(cfg) else cfg.sliding_window,
               layer_types=[_LAYER_TYPE[w is not None] for w in cfg.windows])
    if arch == "Gemma3":
        full = out["rope_parameters"]
        local = (full if cfg.rope_local_base_freq is None
                 else {"rope_type": "default", "rope_theta": cfg.rope_local_base_freq})
        out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    return out


def _gemma_holds(arch: str) -> Callable[[Any], bool]:
    """``HFArch.holds`` of a Gemma: a dense Llama config, no Q/K/V biases, every feature of
    a head rotated (no LongRoPE), zero-centred norms, the embedding's scale and GeGLU;
    Gemma: no sandwich norms, no QK-norm, the scores' scale head_dim's, no soft cap, no
    window, no local rotary; Gemma 2: sandwich norms, no QK-norm, no local rotary;
    Gemma 3: sandwich norms, QK-norm, no soft cap on the scores. Gemma 2 and 3 need
    n_embd divisible by n_head (their configs refuse it otherwise)."""
    def holds(cfg) -> bool:
        if not (not cfg.n_experts and _full_rotary(cfg) and fixes(arch, cfg)
                and getattr(cfg, "mlp_activation", None) == "gelu_tanh"):
            return False
        if arch == "Gemma":
            return (_windowless(cfg)
                    and getattr(cfg, "query_pre_attn_scalar", None) in (None, cfg.head_dim))
        return not cfg.n_embd % cfg.n_head
    return holds


def _gemma_arch(arch: str) -> HFArch:
    model_type = {"Gemma": "gemma", "Gemma2": "gemma2", "Gemma3": "gemma3_text"}[arch]
    return HFArch(kind="llama", model_type=model_type, architecture=f"{arch}ForCausalLM",
                  section=lambda c: _gemma_section(c, arch),
                  config_json=lambda cfg, source: _gemma_config_json(cfg, source, arch),
                  tensor=_llama_tensor, ignored=("*.rotary_emb.*inv_freq",),
                  at_most=("block_size",), holds=_gemma_holds(arch))


# a Gemma3ForConditionalGeneration's language model on disk, in ``HFArch.reading``'s order:
# the Hub's released files, which transformers' save_pretrained still writes (5.23: its
# conversion mapping renamed back; transformers 4.50's names, whose language_model was a
# whole Gemma3ForCausalLM), then the model's own state_dict names since transformers 4.52
# (Gemma3Model's language_model, a Gemma3TextModel beside the vision tower; the head
# outside it), which a checkpoint written from state_dict() holds; Llama's names in a block
_GEMMA3_VLM_LAYOUTS = (
    (("embed.tok.", "language_model.model.embed_tokens."),
     ("blocks.", "language_model.model.layers."), ("head.norm.", "language_model.model.norm."),
     ("head.proj.", "language_model.lm_head.")),
    (("embed.tok.", "model.language_model.embed_tokens."),
     ("blocks.", "model.language_model.layers."), ("head.norm.", "model.language_model.norm."),
     ("head.proj.", "lm_head.")))
# its SigLIP vision tower and multi-modal projector under either layout: never read
_GEMMA3_VLM_VISION = ("vision_tower.*", "multi_modal_projector.*", "model.vision_tower.*",
                      "model.multi_modal_projector.*")


def _prefixed(prefixes: tuple[tuple[str, str], ...]) -> Callable[[str], HFTensor]:
    """``HFArch.tensor`` of a Llama stored under ``prefixes`` ((ours, theirs) pairs, as
    ``LLAMA_PREFIXES``), Llama's names inside a block."""
    def tensor(name: str) -> HFTensor:
        for ours, theirs in prefixes:
            if name.startswith(ours):
                return HFTensor(theirs + name[len(ours):])
        raise KeyError(f"{name}: not a Llama parameter name")
    return tensor


def _gemma3_language_model(c: dict) -> dict:
    """The config.json of a ``Gemma3ForConditionalGeneration``'s language model as a
    ``Gemma3ForCausalLM``'s: its ``text_config`` (what it leaves out, ``Gemma3TextConfig``'s
    defaults: ``_gemma_section``; none at all, every default, as ``Gemma3Config``), with
    ``model_type`` "gemma3_text", the top level's ``tie_word_embeddings`` (default true:
    what ties the multimodal model's head in transformers 5) and its token ids where
    ``text_config`` names none. Refused in one line: a ``text_config`` that is not an
    object or not "gemma3_text", one whose ``tie_word_embeddings`` contradicts the top
    level's, a ``final_logit_softcapping`` (transformers 5's multimodal forward caps no
    logits, its ``Gemma3ForCausalLM`` and older versions do: not one model)."""
    text = c.get("text_config")
    text = {} if text is None else text
    if not isinstance(text, dict):
        raise HFConfigError(f"config.json: text_config={text!r}: expected an object")
    kind = text.get("model_type", "gemma3_text")
    if kind != "gemma3_text":
        raise _refuse("Gemma3", f"text_config.model_type={kind!r} (a Gemma 3's language model "
                      "is 'gemma3_text')")
    tie = bool(_get(c, "tie_word_embeddings", True))
    if text.get("tie_word_embeddings") is not None and bool(text["tie_word_embeddings"]) != tie:
        raise _refuse("Gemma3", f"text_config.tie_word_embeddings="
                      f"{text['tie_word_embeddings']!r} with tie_word_embeddings={tie!r} at "
                      "the top level (transformers 5 ties by the top level's)")
    if text.get("final_logit_softcapping") is not None:
        raise _refuse("Gemma3", "text_config.final_logit_softcapping="
                      f"{text['final_logit_softcapping']!r} in a "
                      "Gemma3ForConditionalGeneration (transformers 5 does not cap its logits, "
                      "its Gemma3ForCausalLM does: null)")
    out = {k: c[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if k in c and k not in text}
    out.update(text, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
               tie_word_embeddings=tie)
    return out


def _gemma3_vlm() -> HFArch:
    """``Gemma3ForConditionalGeneration`` (model_type "gemma3"; Gemma 3 4B, 12B, 27B): its
    language model is GEMMA3's (``_gemma3_language_model``: the same section, holds and
    bounds), read under either layout (``_GEMMA3_VLM_LAYOUTS``), the vision tower and the
    projector ignored; its ``config_json`` is GEMMA3's of the language model, what an
    export writes (as GEMMA3: ``text_source``)."""
    text = GEMMA3
    lm = _gemma3_language_model
    layouts = tuple(_prefixed(p) for p in _GEMMA3_VLM_LAYOUTS)

    def section(c: dict) -> dict:
        c = lm(c)
        try:
            return text.section(c)
        except HFConfigError as e:  # a field of text_config: say so
            raise HFConfigError(str(e).replace("config.json: ", "config.json: text_config.",
                                               1)) from None

    return replace(text, model_type="gemma3", architecture="Gemma3ForConditionalGeneration",
                   section=section,
                   config_json=lambda cfg, source: text.config_json(
                       cfg, None if source is None else lm(source)),
                   bound_reason=lambda c: text.bound_reason(lm(c)),
                   tensor=layouts[0], layouts=layouts, language_model=lm,
                   ignored=text.ignored + _GEMMA3_VLM_VISION)


GEMMA, GEMMA2, GEMMA3 = _gemma_arch("Gemma"), _gemma_arch("Gemma2"), _gemma_arch("Gemma3")
GEMMA3_VLM = _gemma3_vlm()
