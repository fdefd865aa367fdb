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

One module per family, each saying what it maps and from which sources:

- ``arch``: ``HFTensor``, ``HFArch``, ``HFConfigError`` and what the families share (a
  config.json's fields and windows, the predicates their ``holds`` combine);
- ``llama``: ``LlamaForCausalLM`` (``LLAMA``; the rotary tables and the Llama section every
  Llama-family arch builds on) and ``MistralForCausalLM`` (``MISTRAL``);
- ``gpt2``: ``GPT2LMHeadModel`` (``GPT2``);
- ``moe``: experts stored one tensor per expert (shared by Mixtral, the Qwen-MoEs and
  DeepSeek) and ``MixtralForCausalLM`` (``MIXTRAL``);
- ``phi3``: ``Phi3ForCausalLM`` (``PHI3``: Phi-3, Phi-4);
- ``qwen``: ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen2MoeForCausalLM``,
  ``Qwen3MoeForCausalLM`` (``QWEN2``, ``QWEN3``, ``QWEN2_MOE``, ``QWEN3_MOE``);
- ``gemma``: ``GemmaForCausalLM``, ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM`` and the
  multimodal ``Gemma3ForConditionalGeneration``'s language model (``GEMMA``, ``GEMMA2``,
  ``GEMMA3``, ``GEMMA3_VLM``);
- ``deepseek``: ``DeepseekV3ForCausalLM``, ``DeepseekV2ForCausalLM`` (``DEEPSEEK_V3``,
  ``DEEPSEEK_V2``).

This module holds the registry (``ARCHS``, ``arch_for``, ``arch_of``, ``export_arch``) and
what reads and writes a checkpoint's tensors through a description's arch (``section_of``,
``text_source``, ``hf_shapes``, ``state_buffers``, ``to_hf_tensors``).
"""

from __future__ import annotations

import torch

from shardwise.models.hf.arch import HFArch, HFConfigError, HFTensor, requirements
from shardwise.models.hf.arch import _no_gemma as _no_gemma  # apps.lm.export's
from shardwise.models.hf.deepseek import DEEPSEEK_V2, DEEPSEEK_V3, deepseek_compatible
from shardwise.models.hf.gemma import GEMMA, GEMMA2, GEMMA3, GEMMA3_VLM
from shardwise.models.hf.gpt2 import GPT2
from shardwise.models.hf.llama import (
    LLAMA,
    LLAMA_PREFIXES,
    MISTRAL,
    llama_hf_name,
    rope_parameters,
)
from shardwise.models.hf.moe import MIXTRAL, mixtral_compatible
from shardwise.models.hf.phi3 import PHI3
from shardwise.models.hf.phi3 import _rotary_factor as _rotary_factor  # tests/test_hf.py's
from shardwise.models.hf.qwen import (
    QWEN2,
    QWEN2_MOE,
    QWEN3,
    QWEN3_MOE,
    qwen2_moe_compatible,
    qwen3_moe_compatible,
)

__all__ = ["ARCHS", "DEEPSEEK_V2", "DEEPSEEK_V3", "GEMMA", "GEMMA2", "GEMMA3", "GEMMA3_VLM",
           "GPT2", "LLAMA", "LLAMA_PREFIXES", "MISTRAL", "MIXTRAL", "PHI3", "QWEN2", "QWEN2_MOE",
           "QWEN3", "QWEN3_MOE", "HFArch", "HFConfigError", "HFTensor", "arch_for", "arch_of",
           "deepseek_compatible", "export_arch", "hf_shapes", "llama_hf_name",
           "mixtral_compatible", "qwen2_moe_compatible", "qwen3_moe_compatible", "requirements",
           "rope_parameters", "section_of", "state_buffers", "text_source", "to_hf_tensors"]


# arch_for's order: the first that holds a config (Llama before Mistral: both hold a dense
# Llama without Qwen's options; Gemma's options are held by Gemma's archs only; GEMMA3
# before GEMMA3_VLM, which holds what it holds but is read only: text_source)
ARCHS = (LLAMA, GPT2, MIXTRAL, QWEN2, QWEN3, QWEN2_MOE, QWEN3_MOE, MISTRAL, PHI3, GEMMA, GEMMA2,
         GEMMA3, DEEPSEEK_V3, DEEPSEEK_V2, GEMMA3_VLM)


def arch_for(cfg) -> HFArch | None:
    """The arch a Llama config (``models.llama.LlamaConfig``) is exactly, else None: the
    first of ``ARCHS`` of kind "llama" that ``holds`` it. Dense: LLAMA with neither Q/K/V
    biases nor QK-norm (the options each arch fixes: ``arch.OPTIONS``) and no window (a
    Mistral holds it too, but no config says Mistral: ``export_arch`` picks it from a run's
    source), MISTRAL with one window on every layer, QWEN2 with Q/K/V biases, QWEN3 with
    QK-norm (not both: neither has the other's; any windows); with ``n_experts``, MIXTRAL when
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
    for sizes in (config_json, config_json.get("text_config")):
        for key in _SIZES:
            v = sizes.get(key) if isinstance(sizes, dict) else None
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise HFConfigError(f"config.json: {key}={v!r}: expected a whole number >= 1")
    try:
        return arch.section(config_json)
    except KeyError as e:
        raise HFConfigError(f"config.json: no {e.args[0]} ({arch.architecture} needs it)") from None
    except HFConfigError:
        raise
    except (TypeError, ValueError, ZeroDivisionError) as e:  # a size of another kind
        raise HFConfigError(f"config.json: {arch.architecture}'s sizes do not read "
                            f"({type(e).__name__}: {e})") from None


# the sizes of every architecture's config.json (a text_config's too): positive when given
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "n_embd", "n_layer",
          "n_head", "n_positions")


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
