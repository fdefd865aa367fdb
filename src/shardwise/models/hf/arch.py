"""What every Hugging Face arch of ``models.hf`` is made of (the package docstring says what
an arch is): ``HFTensor`` (where one of our parameters lives in a Hugging Face state dict),
``HFArch`` (how one of our model kinds maps onto a ``transformers`` architecture) and
``HFConfigError``; and what the families share: reading a ``config.json``'s fields
(``_get``, ``_refuse``) and its sliding windows (``_window``, ``_NO_WINDOW``,
``_ATTENTION_TYPES``, ``_LAYER_TYPE``), and the predicates on a Llama config that the archs'
``holds`` combine (``_uniform``, ``_windowless``, ``_long_rope``, ``_full_rotary``,
``_no_gemma``, ``_plain``, ``_dense``); and the table of the options each Llama-family arch
fixes (``OPTIONS``, ``SOFT_CAPS``), read by the imports, the ``holds`` and the exports.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

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
    (``config.json``'s ``model_type``). ``section``, ``config_json`` and ``tensor`` are the
    module docstring's; each other field is described where it is declared."""

    kind: str
    model_type: str
    architecture: str
    section: Callable[[dict], dict]
    config_json: Callable[[Any, dict | None], dict]
    # our parameter (or training-state buffer, ``state_buffers``: the routing bias) -> where
    # it lives in the checkpoint; a buffer whose name raises KeyError is not the arch's
    # (DeepSeek-V3's ``e_score_correction_bias`` is, read and written as a parameter is)
    tensor: Callable[[str], HFTensor]
    # fnmatch patterns of checkpoint tensors that are not parameters (buffers older
    # versions saved)
    ignored: tuple[str, ...] = ()
    # the model config whose parameters are every tensor the architecture has (our GPT
    # without biases is GPT-2 with zero biases; those are written as zeros on export)
    complete: Callable[[Any], Any] = lambda cfg: cfg
    # [model] fields a run may set below the checkpoint's value (the Llama's block_size:
    # no parameter depends on it)
    at_most: tuple[str, ...] = ()
    # config.json -> {field: why} for an ``at_most`` bound that is not simply the
    # checkpoint's value (Phi-3's block_size under LongRoPE:
    # original_max_position_embeddings), told when a run asks for more
    bound_reason: Callable[[dict], dict[str, str]] = lambda config_json: {}
    # whether a config of kind ``kind`` is this architecture exactly, sizes aside (its
    # attention and mixture options, ``OPTIONS``, experts, where its sliding windows lie, how
    # much of a head it rotates, LongRoPE); arch_for and export_arch ask it
    holds: Callable[[Any], bool] = lambda config: True
    # for an arch whose tensor map depends on the model's sizes (Phi-3's qkv_proj packs H
    # query and 2 Hkv key/value heads): the ``tensor`` of that config; ``of(config)`` is the
    # arch with it (arch_for and export_arch return archs so made), and ``tensor`` before
    # that raises ValueError
    sized: Callable[[Any], Callable[[str], HFTensor]] | None = None
    # more ``ignored`` patterns for a config (DeepSeek's multi-token-prediction layers,
    # numbered after the model's)
    ignores: Callable[[Any], tuple[str, ...]] = lambda config: ()
    # for an arch whose tensors are saved under several names (a
    # Gemma3ForConditionalGeneration's language model: the Hub's files and its own
    # state_dict since transformers 4.52 differ), the ``tensor`` of each, ``reading``
    # picking the one a checkpoint holds; empty: ``tensor`` only
    layouts: tuple[Callable[[str], HFTensor], ...] = ()
    # for a multimodal arch, config.json -> the config.json of its language model as a
    # text-only checkpoint's (``text_source``); None: not multimodal
    language_model: Callable[[dict], dict] | None = None

    def is_ignored(self, name: str) -> bool:
        """True when tensor ``name`` of a checkpoint matches one of ``ignored``'s patterns
        (fnmatch), so it is not read."""
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


# the values of a config.json's layer_types
_ATTENTION_TYPES = ("full_attention", "sliding_attention")
# the layer_types value of a block without (False) and with (True) a window
_LAYER_TYPE = {False: "full_attention", True: "sliding_attention"}


def _long_rope(cfg) -> bool:
    """A Llama config's rotary has LongRoPE (``models.llama.LongRope``)."""
    return getattr(getattr(cfg, "rope_scaling", None), "short_factor", None) is not None


def _full_rotary(cfg) -> bool:
    """A Llama config rotates all of each head (``rotary_dim`` unset or ``head_dim``)
    without LongRoPE: every transformers class here but Phi-3's does."""
    return getattr(cfg, "rotary_dim", None) in (None, 0, cfg.head_dim) and not _long_rope(cfg)


# The options of a Llama config (``[model]`` fields of ``base.model_config``) that each
# Llama-family arch fixes, as its section gives them: an import sets them (``options``),
# ``holds`` requires each on or off as here (``fixes``) and the exports' refusals list them
# (``requirements``); the one place the HF layer names them. An option an arch does not fix
# is read from its config.json (Qwen2-MoE's Q/K/V biases, ``SOFT_CAPS``) or is no concern
# of its own (DeepSeek's).
_LLAMA_OPTIONS = {"qkv_bias": False, "qk_norm": False}
_GEMMA_BASE = {"qkv_bias": False, "norm_zero_centered": True, "scale_embedding": True}
OPTIONS: dict[str, dict[str, Any]] = {
    "Llama": _LLAMA_OPTIONS, "Mistral": _LLAMA_OPTIONS, "Mixtral": _LLAMA_OPTIONS,
    "Phi3": _LLAMA_OPTIONS,
    "Qwen2": {"qkv_bias": True, "qk_norm": False},
    "Qwen3": {"qkv_bias": False, "qk_norm": True},
    "Qwen2-MoE": {"qk_norm": False},
    "Qwen3-MoE": {"qkv_bias": False, "qk_norm": True},
    "Gemma": {**_GEMMA_BASE, "sandwich_norm": False, "qk_norm": False,
              "attn_logit_softcapping": 0.0, "final_logit_softcapping": 0.0,
              "rope_local_base_freq": 0.0},
    "Gemma2": {**_GEMMA_BASE, "sandwich_norm": True, "qk_norm": False,
               "rope_local_base_freq": 0.0},
    "Gemma3": {**_GEMMA_BASE, "sandwich_norm": True, "qk_norm": True,
               "attn_logit_softcapping": 0.0},
}
# the soft caps a Gemma's config.json holds under our fields' names (Gemma 2 and 3 write
# both), with transformers' default (None: no cap) for the ones its section reads
SOFT_CAPS: dict[str, dict[str, float | None]] = {
    "Gemma2": {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "Gemma3": {"final_logit_softcapping": None}}


def options(arch: str) -> dict[str, Any]:
    """The ``[model]`` fields that arch ``arch`` (an ``OPTIONS`` key) fixes, as its
    section gives them."""
    return dict(OPTIONS[arch])


def fixes(arch: str, cfg) -> bool:
    """A Llama config has each option ``OPTIONS[arch]`` fixes on (or off) as it says."""
    return all(bool(getattr(cfg, k, None)) == bool(v) for k, v in OPTIONS[arch].items())


def requirements(arch: str) -> str:
    """``OPTIONS[arch]`` as the exports' refusals list it ("no qkv_bias, qk_norm")."""
    return ", ".join(k if v else f"no {k}" for k, v in OPTIONS[arch].items())


def all_requirements() -> str:
    """Every arch's ``requirements``, the archs that agree listed together:
    "Llama, Mistral, ...: no qkv_bias, no qk_norm; Qwen2: ..."."""
    by: dict[str, list[str]] = {}
    for arch in OPTIONS:
        by.setdefault(requirements(arch), []).append(arch)
    return "; ".join(f"{', '.join(archs)}: {text}" for text, archs in by.items())


# Gemma's options of a Llama config (``models.llama.LlamaConfig``), each off in a Llama
_GEMMA_OPTIONS = (*(k for k in OPTIONS["Gemma"] if k not in OPTIONS["Llama"]),
                  "query_pre_attn_scalar")


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


def _dense(arch: str, windows: Callable[[Any], bool] = lambda cfg: True
           ) -> Callable[[Any], bool]:
    """``HFArch.holds`` of a dense Llama-family arch ``arch`` (an ``OPTIONS`` key): no
    experts, the options ``OPTIONS[arch]`` fixes (``fixes``), its windows as ``windows``
    allows (any, by default: a Qwen's ``layer_types``), every feature of a head rotated
    (``_full_rotary``), none of Gemma's options."""
    return lambda cfg: (not cfg.n_experts and fixes(arch, cfg) and windows(cfg)
                        and _full_rotary(cfg) and _plain(cfg))
