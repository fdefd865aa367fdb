"""Hugging Face checkpoints of shardwise's decoders: tensor names, layouts and config.json.

An ``HFArch`` says how one of our model kinds maps onto a ``transformers`` architecture:

- ``section(config_json)``: the ``[model]`` fields (``base.config.ModelConfig``) of a
  ``config.json``, refusing in one line what our model cannot hold exactly;
- ``config_json(model_config, source)``: the ``config.json`` of one of our models (the
  source checkpoint's, when the run started from one, with our sizes written over it);
- ``tensor(name)``: where our parameter ``name`` lives in the Hugging Face state dict
  (``HFTensor``: its name, whether it is stored transposed, which piece of a packed tensor,
  or which tensors, one per expert, a stacked one of ours holds).

The description of a model carries its arch (``ModelDescription.hf``), so the engine fills
each rank's slices from a checkpoint without importing a model, and the export packs our
tensors back without knowing which model it writes.

``LlamaForCausalLM``: our names map 1:1 (``models.llama.hf_name``), and both use the
"rotate_half" rotary layout, so no weight is permuted. ``MistralForCausalLM`` (Jiang et al.
2023, arXiv:2310.06825; ``models/mistral/modeling_mistral.py``: Mistral-7B, Mistral-Nemo,
Ministral) is the same Llama under ``MistralConfig``'s defaults, its ``sliding_window`` our
``sliding_window`` on every layer (Mixtral's too); a dense Llama config without a window is
both, so ``arch_for`` says Llama and ``export_arch`` Mistral when the run's source was one,
and with a window on every layer it is a Mistral (a ``LlamaForCausalLM`` has no window).
``GPT2LMHeadModel``: its ``Conv1D`` layers store weights as (in, out), the transpose of
``nn.Linear``'s; ``c_attn`` packs Q, K and V along the output features (Radford et al. 2019,
the released code); our GPT holds them apart (tensor parallelism splits each by heads), with
a key bias (``k_bias``) and the tanh GELU (``activation = "gelu_tanh"``) to be GPT-2
exactly. ``MixtralForCausalLM`` (Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088;
transformers' ``models/mixtral/modeling_mixtral.py``): our Llama with ``n_experts``
(``models.moe``), softmax top-k routing renormalised, dropless; the checkpoint holds each
expert's three linears apart (``block_sparse_moe.experts.{e}.w1/w2/w3``, (out, in)), ours
stacks them (E, in, out). ``Qwen2ForCausalLM`` (Yang et al. 2024, "Qwen2 Technical Report",
arXiv:2407.10671; ``models/qwen2/modeling_qwen2.py``): our Llama with ``qkv_bias``;
``Qwen3ForCausalLM`` (Yang et al. 2025, "Qwen3 Technical Report", arXiv:2505.09388;
``models/qwen3/modeling_qwen3.py``): with ``qk_norm`` and its ``head_dim``; both with
Llama's names (``self_attn.q_proj.bias``, ``self_attn.q_norm.weight``), a sliding window
(``use_sliding_window``) on the layers ``layer_types`` marks "sliding_attention" (default:
from ``max_window_layers`` on) our ``sliding_window`` and ``layer_types``.
``Qwen3MoeForCausalLM`` (same report; ``models/qwen3_moe/modeling_qwen3_moe.py``): Qwen3's
attention and experts in every layer, softmax top-k renormalised only with
``norm_topk_prob``; per-expert ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` (out, in) on
disk, stacked (E, in, out) in ours. ``Qwen2MoeForCausalLM`` (Qwen1.5-MoE-A2.7B,
Qwen2-57B-A14B; the Qwen2 report; ``models/qwen2_moe/modeling_qwen2_moe.py``): Qwen2's
attention (Q/K/V biases) and the same experts, plus a shared expert of its own width whose
output is scaled by ``sigmoid(mlp.shared_expert_gate(x))`` (``moe_shared_expert_gate``).
``Phi3ForCausalLM`` (Phi-3 mini / medium, Phi-4, Phi-4-mini; Abdin et al. 2024, "Phi-3
Technical Report", arXiv:2404.14219; ``models/phi3/modeling_phi3.py``): our Llama, with
only the first ``rotary_dim`` features of a head rotated when ``partial_rotary_factor``
< 1, its ``sliding_window`` ours on every layer as Mistral's (Phi-3-mini-4k: 2047), and
LongRoPE in its short regime (``block_size`` at most ``original_max_position_embeddings``:
``HFArch.bound_reason``); on disk its Q, K, V are the rows of one ``self_attn.qkv_proj``
((H + 2 Hkv) D, h) and gate and up the halves of one ``mlp.gate_up_proj`` (2F, h), pieces
of unequal sizes (``HFTensor.sizes``) whose offsets depend on the head counts, so its
tensor map is made for a config (``HFArch.of``); a checkpoint is read with its own arch
(``export_arch``), since a Llama config does not say Phi-3.
``GemmaForCausalLM``, ``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM`` (``gemma3_text``; Gemma
Team 2024, arXiv:2403.08295, arXiv:2408.00118, arXiv:2503.19786; transformers'
``models/gemma*/modeling_gemma*.py``): our Llama with Gemma's options (``models.llama``:
zero-centred norms, the embedding's sqrt(h), GeGLU; Gemma 2 and 3 the sandwich norms, their
``query_pre_attn_scalar`` and ``layer_types`` windows; Gemma 2 its soft caps; Gemma 3
QK-norm, the logits' soft cap when set and the local rotary base), Llama's tensor names
(their ``post_attention_layernorm`` is the attention output's norm, ours too with
``sandwich_norm``), tied heads by default. The multimodal ``Gemma3ForConditionalGeneration``
(``model_type`` "gemma3": Gemma 3 4B, 12B and 27B) is read for its language model only
(``GEMMA3_VLM``, ``HFArch.language_model``): its ``text_config`` under
``Gemma3TextConfig``'s defaults, its text tensors under either of the names they are saved
with (``HFArch.layouts``, ``HFArch.reading``), the vision tower and the projector ignored
(never read); an export of such a run writes that language model as a text-only
``Gemma3ForCausalLM`` (``text_source``).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Collection

import torch


class HFConfigError(ValueError):
    """A ``config.json`` our models cannot hold exactly, or a checkpoint whose tensors are
    under none of its arch's names (``HFArch.reading``); ``str(err)`` is one line."""


@dataclass(frozen=True)
class HFTensor:
    """Where one of our parameters lives in a Hugging Face state dict.

    name: the Hugging Face tensor's name. transpose: it holds ours transposed (GPT-2's
    ``Conv1D``, (in, out) where ``nn.Linear`` has (out, in)). part: ``(i, n)`` when ours is
    the i-th of n pieces of it along our dim 0, the output features, packed in order
    (GPT-2's ``c_attn`` packs Q, K, V: (0, 3), (1, 3), (2, 3)); None: all of it. sizes:
    the n pieces' sizes relative to each other when they differ (Phi-3's ``qkv_proj``
    packs Q, K, V of H, Hkv and Hkv heads: ``(H, Hkv, Hkv)``, so K's rows start after
    H x D and the whole is (H + 2 Hkv) x D); None: equal. stacked: ours
    stacks E Hugging Face tensors along its dim 0, expert e's named ``name.format(e)``
    (``name`` holds one ``{}``): our (E, in, out) expert weights
    (``models.moe.Experts``) are Mixtral's E ``nn.Linear`` weights (out, in) each
    (``block_sparse_moe.experts.{e}.w1.weight``), so ``transpose`` then applies to each
    expert's matrix; ``part`` is not used with it.

    Shapes: ``shape`` below is always our parameter's full (unsharded) shape.
    """

    name: str
    transpose: bool = False
    part: tuple[int, int] | None = None
    sizes: tuple[int, ...] | None = None
    stacked: bool = False

    def names(self, shape: tuple[int, ...]) -> list[str]:
        """The Hugging Face tensors holding ours: one, or one per expert (``stacked``)."""
        return [self.name.format(e) for e in range(shape[0])] if self.stacked else [self.name]

    def _inner(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape[1:]) if self.stacked else tuple(shape)

    def _span(self, rows: int) -> tuple[int, int]:
        """(offset, total) along the packed dim: where our piece of ``rows`` output features
        starts in the Hugging Face tensor, and that tensor's length there."""
        i, n = self.part
        sizes = self.sizes or (1,) * n
        unit = rows // sizes[i]  # D per head (Phi-3's Q, K, V), or a whole piece
        return unit * sum(sizes[:i]), unit * sum(sizes)

    def hf_dim(self, dim: int, ndim: int) -> int:
        """The Hugging Face tensor's dim that holds dim ``dim`` of ours (of each expert's
        matrix, ``ndim`` its dims, when ``stacked``)."""
        return ndim - 1 - dim if self.transpose and ndim == 2 else dim

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of each Hugging Face tensor in ``names(shape)``."""
        out = list(self._inner(shape))
        if self.part is not None:
            out[0] = self._span(out[0])[1]
        return tuple(reversed(out)) if self.transpose and len(out) == 2 else tuple(out)

    def hf_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """``{name: shape}`` of the Hugging Face tensors holding ours."""
        return dict.fromkeys(self.names(shape), self.hf_shape(shape))

    def reads(self, shape: tuple[int, ...], region: tuple[tuple[int, int], ...]
              ) -> list[tuple[str, tuple[slice, ...], tuple[int | slice, ...]]]:
        """How to fill the block of ours ``region`` (one ``(start, length)`` per dim of our
        full ``shape``: an ep rank's experts along dim 0, a tp rank's rows along its
        ``tp_dim``): ``(name, index, where)`` triples, ``index`` what ``safetensors``'
        ``get_slice(name)[index]`` reads (that block, nothing else) and ``where`` the index
        into the block (as a tensor of its own, zero-based) that ``to_ours`` of it fills."""
        inner_region = region[1:] if self.stacked else region
        inner = self._inner(shape)
        nd = len(inner)
        index = [slice(None)] * nd
        for dim, (start, length) in enumerate(inner_region):
            offset = self._span(inner[0])[0] if self.part is not None and dim == 0 else 0
            d = self.hf_dim(dim, nd)
            index[d] = slice(offset + start, offset + start + length)
        if not self.stacked:
            return [(self.name, tuple(index), ())]
        start, length = region[0]
        return [(self.name.format(e), tuple(index), (e - start,))
                for e in range(start, start + length)]

    def to_ours(self, t: torch.Tensor) -> torch.Tensor:
        """What ``reads``' index read, in our layout (a view); and the inverse, ours (one
        expert's matrix when ``stacked``) in Hugging Face's (a transpose is its own
        inverse)."""
        return t.t() if self.transpose and t.dim() == 2 else t


@dataclass(frozen=True)
class HFArch:
    """How our model kind ``kind`` maps onto the ``transformers`` class ``architecture``
    (``config.json``'s ``model_type``). See the module docstring for ``section``,
    ``config_json`` and ``tensor``. ``ignored``: ``fnmatch`` patterns of checkpoint tensors
    that are not parameters (buffers older versions saved). ``complete(config)``: the model
    config whose parameters are every tensor the architecture has (our GPT without biases
    is GPT-2 with zero biases; those are written as zeros on export). ``at_most``: [model]
    fields a run may set below the checkpoint's value (the Llama's ``block_size``: no
    parameter depends on it). ``bound_reason(config_json)``: ``{field: why}`` for an
    ``at_most`` bound that is not simply the checkpoint's value (Phi-3's ``block_size``
    under LongRoPE: ``original_max_position_embeddings``), told when a run asks for more.
    ``holds(config)``: whether a config of kind ``kind`` is this architecture exactly,
    sizes aside (its attention and mixture options: a Llama's ``qkv_bias``, ``qk_norm``,
    experts, where its sliding windows lie, how much of a head it rotates, LongRoPE);
    ``arch_for`` and ``export_arch`` ask it. ``sized(config)``: for an arch whose tensor
    map depends on the model's sizes (Phi-3's ``qkv_proj`` packs H query and 2 Hkv
    key/value heads), the ``tensor`` of that config; ``of(config)`` is the arch with it
    (``arch_for`` and ``export_arch`` return archs so made), and ``tensor`` before that
    raises ``ValueError``. ``ignores(config)``: more ``ignored`` patterns for a config
    (DeepSeek's multi-token-prediction layers, numbered after the model's). A training-state
    buffer (``state_buffers``: the routing bias) is a checkpoint tensor where ``tensor``
    names it (DeepSeek-V3's ``e_score_correction_bias``), read and written as a parameter
    is; where it raises ``KeyError`` the buffer is not the arch's. ``layouts``: for an arch
    whose tensors are saved under several names (a ``Gemma3ForConditionalGeneration``'s
    language model: the Hub's files and its own ``state_dict`` since transformers 4.52
    differ), the
    ``tensor`` of each, ``reading`` picking the one a checkpoint holds; empty: ``tensor``
    only. ``language_model(config_json)``: for a multimodal arch, the config.json of its
    language model as a text-only checkpoint's (``text_source``); None: not multimodal."""

    kind: str
    model_type: str
    architecture: str
    section: Callable[[dict], dict]
    config_json: Callable[[Any, dict | None], dict]
    tensor: Callable[[str], HFTensor]
    ignored: tuple[str, ...] = ()
    complete: Callable[[Any], Any] = lambda cfg: cfg
    at_most: tuple[str, ...] = ()
    bound_reason: Callable[[dict], dict[str, str]] = lambda config_json: {}
    holds: Callable[[Any], bool] = lambda config: True
    sized: Callable[[Any], Callable[[str], HFTensor]] | None = None
    ignores: Callable[[Any], tuple[str, ...]] = lambda config: ()
    layouts: tuple[Callable[[str], HFTensor], ...] = ()
    language_model: Callable[[dict], dict] | None = None

    def is_ignored(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.ignored)

    def of(self, config: Any) -> HFArch:
        """This arch for the model of ``config``: itself, or with ``tensor`` sized by it and
        ``ignored`` extended by ``ignores(config)``."""
        arch = self if self.sized is None else replace(self, tensor=self.sized(config))
        more = self.ignores(config)
        return replace(arch, ignored=arch.ignored + tuple(more)) if more else arch

    def reading(self, names: Collection[str], where: str) -> HFArch:
        """This arch for reading a checkpoint whose tensors are ``names`` (``where``: the
        file that lists them): itself, or for an arch with ``layouts`` (of kind "llama"),
        with ``tensor`` the first layout whose embedding (``embed.tok.weight``) is among
        ``names``. ``HFConfigError`` (one line, naming ``where``) when none is."""
        if not self.layouts:
            return self
        for tensor in self.layouts:
            if tensor("embed.tok.weight").name in names:
                return replace(self, tensor=tensor)
        tried = " or ".join(t("embed.tok.weight").name for t in self.layouts)
        raise HFConfigError(f"{where}: no {self.architecture} language model in it (no {tried})")


def _get(c: dict, key: str, default: Any) -> Any:
    v = c.get(key)
    return default if v is None else v


def _refuse(arch: str, what: str) -> HFConfigError:
    return HFConfigError(f"config.json: {what}; shardwise's {arch} cannot hold it exactly")


# ---- Llama -----------------------------------------------------------------------------------
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
                n_experts=0, qkv_bias=False, qk_norm=False, dense_layers=[], **_NO_WINDOW,
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


# ---- GPT-2 -----------------------------------------------------------------------------------
# HF's names for GPT-2's activation: the tanh approximation under three names, and the exact one
_GPT2_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_GPT2_PREFIX = (("embed.tok.", "transformer.wte."), ("embed.pos.", "transformer.wpe."),
                ("blocks.", "transformer.h."), ("head.ln_f.", "transformer.ln_f."),
                ("head.proj.", "lm_head."))
_GPT2_INNER = {"attn.q_proj": ("attn.c_attn", (0, 3)), "attn.k_proj": ("attn.c_attn", (1, 3)),
               "attn.v_proj": ("attn.c_attn", (2, 3)), "attn.out_proj": ("attn.c_proj", None),
               "mlp.fc": ("mlp.c_fc", None), "mlp.proj": ("mlp.c_proj", None)}


def _gpt2_section(c: dict) -> dict:
    h = _get(c, "n_embd", 768)
    act = _get(c, "activation_function", "gelu_new")
    if act not in _GPT2_TANH + ("gelu",):
        raise _refuse("GPT", f"activation_function={act!r} (shardwise's GPT has gelu and the "
                      "tanh GELU)")
    if _get(c, "n_inner", 4 * h) != 4 * h:
        raise _refuse("GPT", f"n_inner={c['n_inner']} (shardwise's MLP is 4 x n_embd = {4 * h})")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if _get(c, key, want) != want:
            raise _refuse("GPT", f"{key}={c[key]!r}")
    return dict(kind="gpt", vocab_size=_get(c, "vocab_size", 50257), n_embd=h,
                n_layer=_get(c, "n_layer", 12), n_head=_get(c, "n_head", 12),
                block_size=_get(c, "n_positions", 1024), bias=True, k_bias=True,
                activation="gelu_tanh" if act in _GPT2_TANH else "gelu",
                norm_eps=float(_get(c, "layer_norm_epsilon", 1e-5)),
                tie_weights=bool(_get(c, "tie_word_embeddings", True)))


def _gpt2_config_json(cfg, source: dict | None) -> dict:
    out = dict(source or {"bos_token_id": None, "eos_token_id": None})
    out.pop("_name_or_path", None)
    out.pop("torch_dtype", None)
    act = out.get("activation_function")
    if cfg.activation == "gelu_tanh":
        act = act if act in _GPT2_TANH else "gelu_new"
    else:
        act = "gelu"
    drop = {k: out.get(k, cfg.dropout) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    out.update(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=cfg.vocab_size,
               n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
               n_positions=cfg.block_size, n_inner=None, activation_function=act,
               layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_weights,
               scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
               add_cross_attention=False, dtype="float32", **drop)
    return out


def _gpt2_tensor(name: str) -> HFTensor:
    for ours, theirs in _GPT2_PREFIX:
        if name.startswith(ours):
            rest = name[len(ours):]
            break
    else:
        raise KeyError(f"{name}: not a GPT parameter name")
    if ours != "blocks.":
        return HFTensor(theirs + rest)
    layer, _, inner = rest.partition(".")
    module, _, kind = inner.rpartition(".")
    if module in _GPT2_INNER:
        hf_module, part = _GPT2_INNER[module]
        return HFTensor(f"{theirs}{layer}.{hf_module}.{kind}", transpose=kind == "weight",
                        part=part)
    return HFTensor(f"{theirs}{layer}.{inner}")


def _gpt2_complete(cfg):
    return replace(cfg, bias=True, k_bias=True)


# ---- Mixtral ---------------------------------------------------------------------------------
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


def _whole_window(window: Any) -> int:
    """A config.json's ``sliding_window`` (not null): a whole number >= 1, else one-line
    ``HFConfigError``."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise HFConfigError(f"config.json: sliding_window={window!r}: expected a whole "
                            "number >= 1 or null")
    return window


# the [model] fields of no window
_NO_WINDOW = {"sliding_window": 0, "layer_types": None}


def _window(window: Any, types: list[str] | None = None) -> dict:
    """The [model] fields of a config.json's window: ``sliding_window`` W (null: none) on
    the layers ``types`` marks "sliding_attention" (None: every layer); no window when none
    is marked."""
    if window is None or (types is not None and "sliding_attention" not in types):
        return {**_NO_WINDOW}
    return {"sliding_window": _whole_window(window),
            "layer_types": None if types is None else list(types)}


def _uniform(cfg) -> bool:
    """Every block of a Llama config has the same window (or none has one): what an arch
    with one ``sliding_window`` for all layers (Mistral, Mixtral, Qwen3-MoE) holds."""
    return len(set(getattr(cfg, "windows", (None,)))) <= 1


def _windowless(cfg) -> bool:
    return getattr(cfg, "sliding_window", None) is None


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
# Mixtral's block_sparse_moe: w1 the gate, w2 the down, w3 the up projection
_mixtral_tensor = _moe_tensor("block_sparse_moe", _MIXTRAL_EXPERTS, "Mixtral")


# ---- Mistral ---------------------------------------------------------------------------------
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


# ---- Phi-3 and Phi-4 ----------------------------------------------------------------------------
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


# ---- Qwen2 and Qwen3 ---------------------------------------------------------------------------
# transformers' Qwen2Config / Qwen3Config defaults (configuration_qwen2.py / _qwen3.py), where
# they differ from the Llama's, for a config.json that leaves a field out
_QWEN_DEFAULTS = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                  "num_key_value_heads": 32, "use_sliding_window": False,
                  "sliding_window": 4096, "max_window_layers": 28}
_ATTENTION_TYPES = ("full_attention", "sliding_attention")


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
    """A Qwen2 (``arch`` "Qwen2") is our Llama with ``qkv_bias``, a Qwen3 with ``qk_norm``
    and its ``head_dim`` (default 128, as ``Qwen3Config``); no ``attention_bias`` on a
    Qwen3 (its o_proj would have one too). Its window (``_qwen_window``): our
    ``sliding_window`` and ``layer_types``."""
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
    out.update(qkv_bias=arch == "Qwen2", qk_norm=arch == "Qwen3", **_qwen_window(c))
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


_LAYER_TYPE = {False: "full_attention", True: "sliding_attention"}


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


# ---- Qwen2-MoE and Qwen3-MoE ------------------------------------------------------------------
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
    ``moe_intermediate_size``, dropless. A Qwen3-MoE has Qwen3's ``qk_norm`` and
    ``head_dim`` and no shared expert; a Qwen2-MoE has Q/K/V biases (``qkv_bias``, default
    true) and a shared expert of width ``shared_expert_intermediate_size`` whose output is
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
    if arch == "Qwen3-MoE":
        out.update(qk_norm=True)
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


# ---- Gemma, Gemma 2, Gemma 3 ---------------------------------------------------------------------
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
               "sliding_window": 4096, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    "Gemma3": {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
               "num_hidden_layers": 26, "num_attention_heads": 8,
               "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "head_dim": 256,
               "num_key_value_heads": 4, "tie_word_embeddings": True,
               "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "final_logit_softcapping": None,
               "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
               "rope_local_base_freq": 10_000.0}}
# the activation field of each (GemmaConfig's hidden_act; Gemma 2/3: hidden_activation) and
# the names of the tanh GELU it may hold (GemmaConfig turns the released "gelu" into it)
_GEMMA_ACT = {"Gemma": ("hidden_act", ("gelu_pytorch_tanh", "gelu")),
              "Gemma2": ("hidden_activation", ("gelu_pytorch_tanh",)),
              "Gemma3": ("hidden_activation", ("gelu_pytorch_tanh",))}


def _gemma_defaults(c: dict, arch: str) -> dict:
    nullable = ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window")
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
    (defaults 50 and 30; null: none), Gemma 3 the logits only (its attention takes no
    ``attn_logit_softcapping``, as transformers': not read) and has QK-norm and its local
    rotary (``_gemma3_rope``). Refused: ``use_bidirectional_attention``, another
    activation, ``attention_bias``, a null ``sliding_window`` with sliding layers."""
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
    out.update(norm_zero_centered=True, scale_embedding=True, mlp_activation="gelu_tanh",
               sandwich_norm=False, query_pre_attn_scalar=0.0, attn_logit_softcapping=0.0,
               final_logit_softcapping=0.0, rope_local_base_freq=0.0)
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
    out.update(sandwich_norm=True,
               query_pre_attn_scalar=0.0 if scalar == head_dim else float(scalar),
               final_logit_softcapping=float(c["final_logit_softcapping"] or 0.0))
    if arch == "Gemma2":
        out["attn_logit_softcapping"] = float(c["attn_logit_softcapping"] or 0.0)
        return out
    out.update(qk_norm=True, **_gemma3_rope(c))
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
               final_logit_softcapping=cfg.final_logit_softcapping,
               attn_logit_softcapping=cfg.attn_logit_softcapping,
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
        def g(field: str):
            return getattr(cfg, field, None)

        if not (not cfg.n_experts and not g("qkv_bias") and _full_rotary(cfg)
                and g("norm_zero_centered") and g("scale_embedding")
                and g("mlp_activation") == "gelu_tanh"):
            return False
        if arch == "Gemma":
            return (not g("sandwich_norm") and not g("qk_norm") and _windowless(cfg)
                    and g("query_pre_attn_scalar") in (None, cfg.head_dim)
                    and not g("attn_logit_softcapping") and not g("final_logit_softcapping")
                    and not g("rope_local_base_freq"))
        if cfg.n_embd % cfg.n_head or not g("sandwich_norm"):
            return False
        if arch == "Gemma2":
            return not g("qk_norm") and not g("rope_local_base_freq")
        return bool(g("qk_norm")) and not g("attn_logit_softcapping")
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


# Qwen2-MoE's and Qwen3-MoE's (Qwen2-MoE's conversion_mapping): mlp.gate and
# mlp.experts.{e}.gate_proj/...; Qwen2-MoE's shared expert and its gate under Llama's names
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


def _long_rope(cfg) -> bool:
    """A Llama config's rotary has LongRoPE (``models.llama.LongRope``)."""
    return getattr(getattr(cfg, "rope_scaling", None), "short_factor", None) is not None


def _full_rotary(cfg) -> bool:
    """A Llama config rotates all of each head (``rotary_dim`` unset or ``head_dim``)
    without LongRoPE: every transformers class here but Phi-3's does."""
    return getattr(cfg, "rotary_dim", None) in (None, 0, cfg.head_dim) and not _long_rope(cfg)


# Gemma's options of a Llama config (``models.llama.LlamaConfig``), each off in a Llama
_GEMMA_OPTIONS = ("norm_zero_centered", "scale_embedding", "sandwich_norm",
                  "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                  "rope_local_base_freq")


def _no_gemma(cfg) -> bool:
    """A Llama config has none of Gemma's options (zero-centred norms, the embedding's
    scale, GeGLU, sandwich norms, the scores' own scale, soft caps, a local rotary base):
    what every Llama-family arch but Gemma's is."""
    return (not any(getattr(cfg, k, None) for k in _GEMMA_OPTIONS)
            and getattr(cfg, "mlp_activation", "silu") == "silu")


def _plain(cfg) -> bool:
    """Neither Gemma's options (``_no_gemma``) nor DeepSeek's multi-head latent attention
    (``kv_lora_rank``): what every Llama-family arch but Gemma's and DeepSeek's holds."""
    return _no_gemma(cfg) and not getattr(cfg, "kv_lora_rank", 0)


def _dense(bias: bool, norm: bool, windows: Callable[[Any], bool] = lambda cfg: True
           ) -> Callable[[Any], bool]:
    """``HFArch.holds`` of a dense Llama-family arch: no experts, Q/K/V biases
    (``qkv_bias``) exactly when ``bias``, QK-norm (``qk_norm``) exactly when ``norm``, its
    windows as ``windows`` allows (any, by default: a Qwen's ``layer_types``), every
    feature of a head rotated (``_full_rotary``), none of Gemma's options."""
    return lambda cfg: (not cfg.n_experts and bool(getattr(cfg, "qkv_bias", False)) == bias
                        and bool(getattr(cfg, "qk_norm", False)) == norm and windows(cfg)
                        and _full_rotary(cfg) and _plain(cfg))


def mixtral_compatible(cfg) -> bool:
    """Whether a Llama config with ``n_experts`` is a Mixtral exactly: softmax gating with
    the top k renormalised, dropless (capacity factor 0), no shared expert, no routing bias
    (``moe_bias_update_rate`` 0: Mixtral has no tensor for it, and without it the experts
    chosen would differ), the mixture in every block (no ``dense_layers``), Llama's
    attention (no Q/K/V biases, no QK-norm, all of each head rotated), one window on every
    layer or none."""
    return (_softmax_dropless(cfg) and cfg.moe_norm_topk and not cfg.moe_shared_expert
            and not getattr(cfg, "dense_layers", ()) and not getattr(cfg, "qkv_bias", False)
            and not getattr(cfg, "qk_norm", False) and _uniform(cfg) and _full_rotary(cfg)
            and _plain(cfg))


def qwen3_moe_compatible(cfg) -> bool:
    """Whether a Llama config with ``n_experts`` is a Qwen3-MoE exactly: softmax gating
    (the top k renormalised or not: ``norm_topk_prob``), dropless, no shared expert, no
    routing bias (``moe_bias_update_rate`` 0), Qwen3's attention (QK-norm, no Q/K/V
    biases, all of each head rotated), one window on every layer or none."""
    return (_softmax_dropless(cfg) and not cfg.moe_shared_expert
            and not getattr(cfg, "qkv_bias", False) and getattr(cfg, "qk_norm", False)
            and _uniform(cfg) and _full_rotary(cfg) and _plain(cfg))


def qwen2_moe_compatible(cfg) -> bool:
    """Whether a Llama config with ``n_experts`` is a Qwen2-MoE exactly: softmax gating
    (renormalised or not: ``norm_topk_prob``), dropless, no routing bias, a shared expert
    (any width: ``shared_expert_intermediate_size``) with its sigmoid gate
    (``moe_shared_expert_gate``), no QK-norm, all of each head rotated; Q/K/V biases or not
    (``qkv_bias``)."""
    return (_softmax_dropless(cfg) and cfg.moe_shared_expert
            and getattr(cfg, "moe_shared_expert_gate", False)
            and not getattr(cfg, "qk_norm", False)
            and _full_rotary(cfg) and _plain(cfg))


LLAMA = HFArch(kind="llama", model_type="llama", architecture="LlamaForCausalLM",
               section=_llama_section, config_json=_llama_config_json, tensor=_llama_tensor,
               ignored=("*.rotary_emb.inv_freq",), at_most=("block_size",),
               holds=_dense(bias=False, norm=False, windows=_windowless))
GPT2 = HFArch(kind="gpt", model_type="gpt2", architecture="GPT2LMHeadModel",
              section=_gpt2_section, config_json=_gpt2_config_json, tensor=_gpt2_tensor,
              ignored=("transformer.h.*.attn.bias", "transformer.h.*.attn.masked_bias"),
              complete=_gpt2_complete)
MIXTRAL = HFArch(kind="llama", model_type="mixtral", architecture="MixtralForCausalLM",
                 section=_mixtral_section, config_json=_mixtral_config_json,
                 tensor=_mixtral_tensor, ignored=("*.rotary_emb.inv_freq",),
                 at_most=("block_size",), holds=mixtral_compatible)
# a dense Llama is a Mistral too: arch_for says Llama (Mistral with a window: a Llama has none),
# export_arch Mistral for a Mistral's run
MISTRAL = HFArch(kind="llama", model_type="mistral", architecture="MistralForCausalLM",
                 section=_mistral_section, config_json=_mistral_config_json,
                 tensor=_llama_tensor, ignored=("*.rotary_emb.inv_freq",),
                 at_most=("block_size",),
                 holds=_dense(bias=False, norm=False, windows=_uniform))
# Phi-3 / Phi-4: a dense Llama with Llama's attention, any rotary_dim, no Llama 3 scaling, one
# window on every layer or none (Mistral's); arch_for says Llama or Mistral for a Llama that
# rotates all of each head without LongRoPE, Phi-3 for one that does not
PHI3 = HFArch(kind="llama", model_type="phi3", architecture="Phi3ForCausalLM",
              section=_phi3_section, config_json=_phi3_config_json, tensor=_phi3_unsized,
              ignored=("*.rotary_emb.inv_freq",), at_most=("block_size",),
              bound_reason=_phi3_bound,
              holds=lambda cfg: (not cfg.n_experts and not getattr(cfg, "qkv_bias", False)
                                 and not getattr(cfg, "qk_norm", False) and _uniform(cfg)
                                 and (cfg.rope_scaling is None or _long_rope(cfg))
                                 and _plain(cfg)),
              sized=_phi3_tensor)


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
                      at_most=("block_size",), holds=_dense(bias=name == "Qwen2",
                                                            norm=name == "Qwen3"))
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

# ---- DeepSeek-V2 / V3 -------------------------------------------------------------------------
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

GEMMA, GEMMA2, GEMMA3 = _gemma_arch("Gemma"), _gemma_arch("Gemma2"), _gemma_arch("Gemma3")
GEMMA3_VLM = _gemma3_vlm()
# arch_for's order: the first that holds a config (Llama before Mistral: both hold a dense
# Llama without Qwen's options; Gemma's options are held by Gemma's archs only; GEMMA3
# before GEMMA3_VLM, which holds what it holds but is read only: text_source)
ARCHS = (LLAMA, GPT2, MIXTRAL, QWEN2, QWEN3, QWEN2_MOE, QWEN3_MOE, MISTRAL, PHI3, GEMMA, GEMMA2,
         GEMMA3, DEEPSEEK_V3, DEEPSEEK_V2, GEMMA3_VLM)


def arch_for(cfg) -> HFArch | None:
    """The arch a Llama config (``models.llama.LlamaConfig``) is exactly, else None: the
    first of ``ARCHS`` of kind "llama" that ``holds`` it. Dense: LLAMA with neither
    ``qkv_bias`` nor ``qk_norm`` and no window (a Mistral holds it too, but no config says
    Mistral: ``export_arch`` picks it from a run's source), MISTRAL with one window on every
    layer, QWEN2 with ``qkv_bias``, QWEN3 with ``qk_norm`` (not both: neither has the
    other's; any windows); with ``n_experts``, MIXTRAL when
    ``mixtral_compatible`` (no QK-norm, no shared expert), QWEN3_MOE when
    ``qwen3_moe_compatible`` (QK-norm, no shared expert), QWEN2_MOE when
    ``qwen2_moe_compatible`` (a gated shared expert, no QK-norm); each of these only when
    every feature of a head is rotated, PHI3 when only the first ``rotary_dim`` are or with
    LongRoPE (no Llama 3 scaling; one window on every layer or none). The arch is sized by
    ``cfg`` (``HFArch.of``)."""
    arch = next((arch for arch in ARCHS if arch.kind == "llama" and arch.holds(cfg)), None)
    return None if arch is None else arch.of(cfg)


def arch_of(config_json: dict) -> HFArch:
    """The arch of a ``config.json`` (its ``model_type``, else its ``architectures``);
    ``HFConfigError`` (one line, naming what is supported) for any other."""
    model_type = config_json.get("model_type")
    names = config_json.get("architectures") or []
    for arch in ARCHS:
        if model_type == arch.model_type or (model_type is None and arch.architecture in names):
            return arch
    what = ", ".join(names) if names else f"model_type {model_type!r}"
    names_ = [a.architecture for a in ARCHS]
    supported = ", ".join(names_[:-1]) + " and " + names_[-1]
    raise HFConfigError(f"config.json: unsupported architecture {what} (shardwise loads "
                        f"{supported})")


def export_arch(description, source: dict | None) -> HFArch | None:
    """The arch ``shardwise export`` writes a model as, and ``model.init_from`` reads its
    checkpoint with (``ModelDescription.with_checkpoint_arch``, ``source`` that
    checkpoint's config.json), one rule: the arch its run's source ``config.json`` names
    (``source``: ``model.init_from``'s, kept in the run's checkpoints; ``arch_of``) when
    that arch holds the model exactly (its ``kind`` and ``holds(config)``, windows
    included); else the model's own, ``description.hf`` (``arch_for`` of a Llama config).
    So a Mistral in is a Mistral out, its window and context kept, while a model trained
    here (no source), or one its source's arch cannot hold, is written as ``arch_for``
    says: a Llama config without a window, which a Mistral holds too, as a Llama. A Phi-3
    in is a Phi-3 out, its Q/K/V and gate/up read and written packed (a Phi-3 that rotates
    all of each head is a Llama config too, or a Mistral's with a window). The arch is
    sized by the model's config (``HFArch.of``). None: no arch holds it."""
    if source is None:
        return description.hf
    try:
        arch = arch_of(source)
        fits = arch.kind == description.kind and arch.holds(description.config)
    except (HFConfigError, KeyError):  # a source config.json that no longer reads
        fits = False
    return arch.of(description.config) if fits else description.hf


def text_source(source: dict | None) -> dict | None:
    """The config.json ``shardwise export`` writes over, for a run whose
    ``model.init_from`` config.json was ``source``: a multimodal checkpoint's language model
    as a text-only checkpoint's (``HFArch.language_model``: a
    ``Gemma3ForConditionalGeneration``'s ``text_config`` as a ``Gemma3ForCausalLM``'s, so
    the run is written as that: the vision tower is not carried); else ``source`` (None, or
    one that no longer reads, too)."""
    try:
        lm = arch_of(source).language_model if source is not None else None
        return source if lm is None else lm(source)
    except (HFConfigError, KeyError):  # export_arch then writes the model's own arch
        return source


def section_of(config_json: dict) -> dict:
    """The ``[model]`` fields of a ``config.json`` (``arch_of(...).section``); one-line
    ``HFConfigError`` for an architecture or option our models do not have, or a size
    missing."""
    arch = arch_of(config_json)
    try:
        return arch.section(config_json)
    except KeyError as e:
        raise HFConfigError(f"config.json: no {e.args[0]} ({arch.architecture} needs it)") from None


def hf_shapes(description, model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{Hugging Face name: shape}`` of every tensor holding ``model``'s parameters (a
    meta model is enough), through ``description.hf``; a tied head is the embedding's."""
    hf = description.hf
    tied = description.tied
    out: dict[str, tuple[int, ...]] = {}
    for name, p in model.named_parameters():  # a tied head is listed once, as the embedding
        if tied is not None and name == tied[1]:
            continue
        out.update(hf.tensor(name).hf_shapes(tuple(p.shape)))
    for name, b in state_buffers(description, model).items():
        out.update(hf.tensor(name).hf_shapes(tuple(b.shape)))
    return out


def state_buffers(description, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s training-state buffers (those its modules name in ``state_buffers``)
    that ``description.hf`` has a checkpoint tensor for (``HFArch``), by name."""
    out = {}
    for mname, m in model.named_modules():
        for n in getattr(m, "state_buffers", ()):
            b = m._buffers.get(n)
            if b is None:
                continue
            name = f"{mname}.{n}" if mname else n
            try:
                description.hf.tensor(name)
            except KeyError:
                continue
            out[name] = b
    return out


def to_hf_tensors(description, tensors: dict[str, torch.Tensor],
                  complete_model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Our full tensors (the single-process names and shapes, a tied head absent) as the
    Hugging Face state dict: transposed, packed (``c_attn``), one tensor per expert
    (Mixtral's), contiguous, none sharing memory. ``complete_model``: the model of
    ``description.hf.complete(config)`` (on meta), whose parameters ours lacks are written
    as zeros (GPT-2's biases for a GPT without them); None: ``tensors`` are all there is.
    Raises ``KeyError`` for a name the description's arch does not know."""
    hf = description.hf
    tied = description.tied
    dtype = next(iter(tensors.values())).dtype
    wanted = ({n: tuple(p.shape) for n, p in complete_model.named_parameters()}
              if complete_model is not None else {n: tuple(t.shape) for n, t in tensors.items()})
    if complete_model is not None:  # the training-state buffers the arch has, when saved
        wanted.update({n: tuple(b.shape) for n, b in
                       state_buffers(description, complete_model).items() if n in tensors})
    out: dict[str, torch.Tensor] = {}
    packed: dict[str, tuple[HFTensor, dict[int, torch.Tensor]]] = {}
    for name, shape in wanted.items():
        if tied is not None and name == tied[1]:
            continue
        spec = hf.tensor(name)
        t = tensors.get(name)
        t = torch.zeros(shape, dtype=dtype) if t is None else t
        if spec.stacked:  # one tensor per expert
            for e, name_e in enumerate(spec.names(tuple(t.shape))):
                out[name_e] = spec.to_ours(t[e]).contiguous().clone()
            continue
        t = spec.to_ours(t)  # our layout -> theirs (a transpose is its own inverse)
        if spec.part is None:
            out[spec.name] = t.contiguous().clone()
        else:
            packed.setdefault(spec.name, (spec, {}))[1][spec.part[0]] = t
    for name, (spec, parts) in packed.items():
        dim = spec.hf_dim(0, parts[0].dim())  # the pieces lie along our output features
        out[name] = torch.cat([parts[i] for i in sorted(parts)], dim=dim).contiguous()
    return out
