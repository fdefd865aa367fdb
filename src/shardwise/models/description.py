"""What the engine needs to know about a model, without importing it.

A ``ModelDescription`` tells the engine, the checkpoint format, ``shardwise memory`` and the
planner everything they use about a decoder: how to build the single-process model (on the
meta device, see ``models.meta_init``), its layers in pipeline order, and a tensor-parallel
plan naming the style of each submodule, in the spirit of PyTorch's ``parallelize_module``
plans and torchtitan's ``parallelize_llama`` (there each style is a ``ParallelStyle`` over
DTensors; here each names one of Megatron-LM's layers, Shoeybi et al. 2019, section 3, and
Korthikanti et al. 2022 for sequence parallelism). The engine applies the plan with
``parallel.tensor_parallel.plan.parallelize``; nothing under ``engine`` imports a model.

The styles (``STYLES``), keyed by module-name patterns (``fnmatch``: ``*`` matches any run of
characters, dots included) on the full model's module names:

=====================  =====================================================================
``column``             ``nn.Linear`` split by output features (heads, MLP width); its input
                       enters the tensor-parallel region (identity forward, all-reduce of the
                       gradient backward; an all-gather along the sequence under SP) unless
                       an enclosing ``attention`` / ``shared_input`` module did it once.
``row``                ``nn.Linear`` split by input features; partial outputs all-reduced
                       (reduce-scattered along the sequence under SP); a bias is added once.
``vocab_embedding``    ``nn.Embedding`` split by vocabulary rows (padded to a multiple of tp).
``vocab_head``         the ``nn.Linear`` to the vocabulary, split by vocabulary rows; its
                       logits stay split for the vocab-parallel cross-entropy.
``attention``          a module computing on heads: its input enters the region once for its
                       ``column`` children, and its forward is a parallel region for dropout
                       (each tp rank draws its own masks, Megatron's RNG tracker).
``shared_input``       a module whose ``column`` children read one input (SwiGLU's gate and
                       up): the input enters the region once.
``dropout``            ``nn.Dropout`` on a replicated activation (the same mask on every tp
                       rank; under SP, where each rank holds other tokens, its own).
``sequence_parallel``  a token-wise module (a norm) that, under SP, runs on this rank's slice
                       of the sequence; its replicated parameters' gradients are summed over
                       tp by the optimizer.
``sequence_positions`` a module fed position ids of the whole sequence (a learned position
                       embedding): under SP it reads this rank's slice of them.
``experts``            stacked expert weights (``models.moe.Experts``: ``gate_proj`` and
                       ``up_proj`` (E, C, F), ``down_proj`` (E, F, C), ``forward(x, counts)``
                       on tokens sorted by expert): split by expert over ep and by the width
                       F over tp; tokens reach their experts by all-to-all over ep
                       (``parallel.experts``). Its parameters are expert parameters: their
                       gradients are reduced over the dp ranks holding the same experts.
``moe``                a mixture-of-experts module (router, ``experts``, a shared expert):
                       without SP nothing (its children communicate). Under SP its input
                       is all-gathered along the sequence once, so the router sees whole
                       sequences; inside, nothing talks over tp (columns do not enter, rows
                       and ``experts`` leave partial sums), and its output, the ranks'
                       partial sums, is reduce-scattered along the sequence (backward: the
                       conjugates). Its replicated parameters (the router) then hold partial
                       gradients, summed over tp by the optimizer like a norm's.
``partial_grad``       a module on this rank's share of the heads whose parameters are
                       replicated (Qwen3's q_norm / k_norm: D weights every head shares):
                       each rank's gradient is its heads' part, summed over tp by the
                       optimizer (HF's "replicated_with_grad_allreduce").
``replicate``          left as it is (the default for any module the plan does not name).
=====================  =====================================================================

Mixture-of-experts layers (``models.moe.MoE``) are found by what they offer, not their type:
a module with ``pop_router_stats()`` reports its auxiliary loss and expert load per step, and
its ``aux_grad_scale`` is the factor the engine multiplies its loss by (divided by tp under
SP, where every tp rank computes the same auxiliary loss of the whole sequence inside its
``moe`` region and each gives its share of the gradient, summed with the router's other
partial gradients); if it also has
``update_bias(load)``, the engine calls it after every step with the (E,) load of its
experts over the global batch (the same on every rank). Buffers are refused (they have no
value on the meta device) except those a module names in ``state_buffers``: training state
that starts at zero (``models.moe.MoE.expert_bias``), built as zeros, checkpointed
replicated (``engine.state``).

Models register under a kind (``register_model``): ``"gpt"`` and ``"llama"`` are shardwise's
own; ``examples/own_decoder.py`` registers one of yours.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

import torch.nn as nn

from shardwise.base.model_config import (
    ModelSection,
    import_model_module,
    register_section,
    unknown_kind,
)

from shardwise.base.config import ATTENTION_MASKS

STYLES = ("column", "row", "vocab_embedding", "vocab_head", "attention", "shared_input",
          "dropout", "sequence_parallel", "sequence_positions", "experts", "moe",
          "partial_grad", "replicate")
_MODULE_TYPES = {"column": nn.Linear, "row": nn.Linear, "vocab_head": nn.Linear,
                 "vocab_embedding": nn.Embedding, "dropout": nn.Dropout}


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``[("embed", ...), ("blocks.0", ...), ..., ("head", ...)]``: the pipeline layers of a
    decoder built as ``embed -> blocks[i] -> head`` (shardwise's GPT and Llama)."""
    return ([("embed", model.embed)] + [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
            + [("head", model.head)])


def style_of(plan: Mapping[str, str], name: str) -> str:
    """The style ``plan`` gives module ``name``: the last matching pattern's, else
    "replicate"."""
    style = "replicate"
    for pattern, s in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            style = s
    return style


@dataclass(frozen=True)
class ModelDescription:
    """A decoder as the engine sees it.

    kind: the registered name ("gpt", "llama", yours); it appears in the start-up line.
    config: the model's own config (a frozen dataclass), for the record.
    build: ``() -> nn.Module``, the single-process model drawing its initial values from the
        default torch generator (``torch.manual_seed(seed); build()`` is the reference every
        layout equals); run on the meta device by the engine. Every parameter must be given
        its value by an ``nn.init``-style in-place write (``models.meta_init``).
    layers: ``model -> [(name, module)]`` in pipeline order: the first takes token ids
        (B, T) int64, each passes (B, T, hidden_size) activations, the last returns logits
        (B, T, vocab_size). Names are the modules' names in the model.
    tp_plan: module-name pattern -> style (see the module docstring).
    hidden_size: width of the activations between layers (C).
    vocab_size, block_size: tokens V and the longest sequence T.
    tied: ``(embedding weight, head weight)`` parameter names when the head shares the
        embedding's matrix, else None.
    tp_divides: what tp must divide, ``{"model.n_head (attention heads)": 12, ...}``; the
        engine checks them first, so a bad tp is one line naming the size.
    n_layer, attention_width: L and H * D for the attention term of the FLOP count.
    attention_windows: per block (L of them), the sliding window W its queries attend in
        (tokens; None: every earlier key), for the FLOP count and the planner; () (the
        default): no block has one.
    n_experts: experts per mixture-of-experts layer (0: none); ep must divide it.
    capacity_factor: the experts' capacity factor c (``models.moe.MoE``: an expert takes at
        most ceil(c N k / E) of a micro-batch's N tokens' k assignments, the rest dropped);
        0 (the default): dropless. When > 0 the engine reports the dropped assignments per
        step (``expert_dropped``); it needs ``n_experts`` > 0.
    keep_high_precision: module-name patterns (``fnmatch``, as in ``tp_plan``) of the
        ``nn.Linear`` layers kept out of low-precision matmuls (``training.precision = "fp8"``,
        ``parallel.float8``) besides the ``vocab_head``: a mixture of experts' router, whose
        top-k decisions float8 rounding would change (torchtitan's ``filter_fqns``). Default
        (): none.
    context_parallel: the model reads token positions from ``models.sequence.positions``,
        attends through ``models.gpt.causal_attention`` and sums any per-sequence statistic
        (an MoE's token counts per expert) with ``models.sequence.sequence_total``, so a
        rank may hold only some chunks of each sequence (``parallel.cp > 1``); False (the default for your own model): the
        engine refuses cp > 1, since positions computed as ``arange(T)`` would be wrong.
    ring_attention: with ``context_parallel``, whether ring attention can stand in for the
        model's attention (True, the default); False (DeepSeek's MLA, Gemma 2's soft cap):
        only the all-to-all (``parallel.cp_comm = "all_to_all"``), which runs the model's own.
    written_scores: 0 (the default): attention through a fused kernel, nothing T x T kept;
        n > 0: the attention writes its (B, H, T, T) scores out (``models.gpt.causal_attention``
        on its math path) and its backward keeps the fp32 softmax, the probabilities cast
        back to the compute dtype (a tensor of their own below fp32) and n - 1 more T x T
        tensors of the compute dtype (Gemma 2's soft cap: the tanh's output, n = 2). The
        planner counts them in activation memory and memory-bound time (``planner.memory``,
        ``planner.simulate.block_ops``).
    attention_mask: "causal" (the default) or "block_causal": the model attends through
        ``models.gpt.causal_attention``, which keeps a token within its document when the
        current ``models.sequence`` shard carries document ids; with "block_causal" the
        engine computes them from each micro-batch's tokens and the tokenizer's end-of-text
        id (``EngineConfig.eos_id``) and sets them around every forward of its chunks.
    hf: a ``models.hf.HFArch`` (how the model maps onto a Hugging Face architecture: its
        config.json, tensor names and layouts; ``model.init_from`` and ``shardwise export``
        read it, each with the checkpoint's own arch when that holds the model:
        ``with_checkpoint_arch``), or None when it has none.
    """

    kind: str
    config: Any
    build: Callable[[], nn.Module]
    tp_plan: Mapping[str, str]
    hidden_size: int
    vocab_size: int
    block_size: int
    n_layer: int
    attention_width: int
    layers: Callable[[nn.Module], list[tuple[str, nn.Module]]] = decoder_layers
    tied: tuple[str, str] | None = None
    tp_divides: Mapping[str, int] = field(default_factory=dict)
    n_experts: int = 0
    capacity_factor: float = 0.0
    keep_high_precision: tuple[str, ...] = ()
    context_parallel: bool = False
    ring_attention: bool = True
    hf: Any = None
    attention_windows: tuple[int | None, ...] = ()
    written_scores: int = 0
    attention_mask: str = "causal"

    def __post_init__(self):
        if self.attention_mask not in ATTENTION_MASKS:
            raise ValueError(f"description of {self.kind!r}: attention_mask="
                             f"{self.attention_mask!r}; expected {' or '.join(ATTENTION_MASKS)}")
        w = self.attention_windows
        if w and (len(w) != self.n_layer
                  or any(x is not None and (not isinstance(x, int) or x < 1) for x in w)):
            raise ValueError(f"description of {self.kind!r}: attention_windows={w!r}; "
                             f"expected () or n_layer={self.n_layer} of None or ints >= 1")
        if self.capacity_factor < 0:
            raise ValueError(f"description of {self.kind!r}: capacity_factor="
                             f"{self.capacity_factor}; expected >= 0 (0: dropless)")
        if self.capacity_factor and not self.n_experts:
            raise ValueError(f"description of {self.kind!r}: capacity_factor="
                             f"{self.capacity_factor} needs experts (n_experts is 0)")
        for pattern, style in self.tp_plan.items():
            if style not in STYLES:
                raise ValueError(f"tp plan of {self.kind!r}: {pattern!r} has style {style!r}; "
                                 f"expected one of {', '.join(STYLES)}")

    def with_checkpoint_arch(self, config_json: dict, files=None) -> ModelDescription:
        """This description with ``hf`` the arch that reads a Hugging Face checkpoint whose
        config.json is ``config_json`` into this model: the checkpoint's own arch when it
        holds the model, else ``hf`` (``models.hf.export_arch``'s rule). A Llama config
        names no arch, and Phi-3's packed Q/K/V and gate/up are not the Llama's tensors.
        ``files``: the checkpoint's tensors (``checkpoint.hf.SafetensorsDir``: its
        ``names()`` and ``listing``), for an arch saved under several names
        (``HFArch.reading``: a ``Gemma3ForConditionalGeneration``'s language model; its
        one-line ``HFConfigError`` when none is there); None: the arch's first."""
        from dataclasses import replace

        from shardwise.models.hf import export_arch

        hf = export_arch(self, config_json)
        if hf is not None and files is not None:
            hf = hf.reading(set(files.names()), str(files.listing))
        return replace(self, hf=hf)

    def style_of(self, name: str) -> str:
        """The style of module ``name`` (``style_of`` on ``tp_plan``)."""
        return style_of(self.tp_plan, name)

    def is_high_precision(self, name: str) -> bool:
        """Whether module ``name`` (its full model name) matches ``keep_high_precision``."""
        return any(fnmatch.fnmatchcase(name, p) for p in self.keep_high_precision)

    def vocab_params(self, model: nn.Module) -> tuple[str, ...]:
        """Names of the parameters split by vocabulary rows (padded to a multiple of tp)."""
        return tuple(f"{n}.weight" for n, _ in model.named_modules()
                     if self.style_of(n) in ("vocab_embedding", "vocab_head"))

    def check_plan(self, model: nn.Module) -> None:
        """Raise ``ValueError`` (one line) for a pattern that names no module of ``model`` or
        a style on a module it does not fit (``column`` on a non-Linear ...), and for a
        ``keep_high_precision`` pattern that names no module."""
        names = dict(model.named_modules())
        for pattern in self.keep_high_precision:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise ValueError(f"keep_high_precision of {self.kind!r}: {pattern!r} names "
                                 "no module")
        for pattern, style in self.tp_plan.items():
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise ValueError(f"tp plan of {self.kind!r}: {pattern!r} names no module")
            want = _MODULE_TYPES.get(style)
            for n in hits:
                if want is not None and not isinstance(names[n], want):
                    raise ValueError(f"tp plan of {self.kind!r}: {n} is a "
                                     f"{type(names[n]).__name__}; style {style!r} needs "
                                     f"an nn.{want.__name__}")

    def attention_keys(self, seq_len: int | None = None) -> int:
        """Keys each query is counted against, summed over the blocks: ``L T`` without a
        window (PaLM counts the causal triangle's masked half too), ``min(T, W)`` for a block
        with a sliding window of W (the band counted whole, as the triangle is; so the count
        is continuous at T = W). ``seq_len``: T, default ``block_size``."""
        t = self.block_size if seq_len is None else seq_len
        if not self.attention_windows:
            return self.n_layer * t
        return sum(t if w is None else min(t, w) for w in self.attention_windows)

    def flops_per_token(self, model: nn.Module, seq_len: int | None = None) -> float:
        """Training FLOPs per token, ``6 N + 12 (H D) sum_l K_l`` (PaLM, appendix B; see
        ``perf.flops``): N every parameter but embedding lookups, the head counted even
        when tied, a parameter marked ``active_fraction`` (an expert's: top_k / E) counted
        for that share; K_l the keys a query of block l is counted against
        (``attention_keys``: T, or min(T, W) under a sliding window of W). ``model`` may be
        on the meta device."""
        lookups = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
        n = sum(p.numel() * getattr(p, "active_fraction", 1.0)
                for p in model.parameters()) - lookups
        if self.tied is not None:
            n += model.get_parameter(self.tied[1]).numel()
        return 6.0 * n + 12.0 * self.attention_width * self.attention_keys(seq_len)


@dataclass(frozen=True)
class ModelKind:
    """A registered model: its config type, ``describe(config) -> ModelDescription`` and
    ``from_section(model_section, vocab_size) -> config`` (the ``[model]`` section of a run's
    config, ``vocab_size`` the tokenizer's)."""

    name: str
    config_type: type
    describe: Callable[[Any], ModelDescription]
    from_section: Callable[[Any, int], Any]


_KINDS: dict[str, ModelKind] = {}
_OWN_REGISTERED = False


def _own_first() -> None:
    """Register shardwise's own kinds ("gpt", "llama") once, before any other: importing
    ``shardwise.models`` no longer does it (it imports no model: see its docstring)."""
    global _OWN_REGISTERED
    if _OWN_REGISTERED:
        return
    _OWN_REGISTERED = True  # first: _register_own calls register_model
    try:
        from shardwise.models import _register_own

        _register_own()
    except BaseException:
        _OWN_REGISTERED = False
        raise


def register_model(name: str, config_type: type, describe: Callable[[Any], ModelDescription],
                   from_section: Callable[[Any, int], Any] | None = None) -> None:
    """Make ``model.kind = name`` trainable in every layout (see ``ModelKind``). Registering
    a name again replaces it (shardwise's own are registered first, so yours win). Call it
    at import time of the module that defines the model, so spawned ranks, which import that
    module again (``model.module`` on the command line), know it too.

    A ``config_type`` that subclasses ``base.model_config.ModelSection`` is the kind's
    ``[model]`` section itself: its fields are the section's (``--help --model.kind name``
    lists them), and ``from_section`` may be left out (the section with ``vocab_size`` the
    tokenizer's when 0). Another config type takes the section of every decoder field
    (``ModelConfig``) through its ``from_section``."""
    _own_first()  # "gpt" and "llama" first, whoever registers first
    if isinstance(config_type, type) and issubclass(config_type, ModelSection):
        register_section(name, config_type)
        from_section = from_section or _section_itself
    else:
        register_section(name)  # a name the config's door knows
    if from_section is None:
        raise TypeError(f"register_model({name!r}): from_section is needed for a config type "
                        "that is not a ModelSection")
    _KINDS[name] = ModelKind(name, config_type, describe, from_section)


def _section_itself(section: ModelSection, vocab_size: int) -> ModelSection:
    """A section-typed kind's config: the section, ``vocab_size`` the tokenizer's when 0."""
    return section if section.vocab_size else section.model_copy(update={"vocab_size":
                                                                          vocab_size})


def model_kinds() -> tuple[str, ...]:
    """The registered kinds, shardwise's own first."""
    _own_first()
    return tuple(_KINDS)


def model_kind(name: str) -> ModelKind:
    """The registered kind ``name``; ``ValueError`` (one line, listing the kinds) if none."""
    kinds = model_kinds()
    if name not in _KINDS:
        raise ValueError(unknown_kind(name, kinds))
    return _KINDS[name]


def section_kind(section: Any) -> ModelKind:
    """The registered kind of a run's ``[model]`` section, after importing
    ``section.module`` (``import_model_module``); ``ValueError`` (one line) for a module
    that cannot be imported or a kind nobody registered."""
    import_model_module(getattr(section, "module", ""))
    return model_kind(section.kind)


def describe(model: Any) -> ModelDescription:
    """``model`` as a ``ModelDescription``: a description itself, or a registered config
    (``GPTConfig``, ``LlamaConfig``, yours). Raises ``TypeError`` for anything else."""
    if isinstance(model, ModelDescription):
        return model
    model_kinds()
    for kind in _KINDS.values():
        if isinstance(model, kind.config_type):
            return kind.describe(model)
    raise TypeError(f"{type(model).__name__} is not a registered model config "
                    "(shardwise.register_model)")


def describe_section(section: Any, vocab_size: int) -> ModelDescription:
    """The model of a run's ``[model]`` section (``section.kind``, registered by
    ``section.module`` when set: imported first); ``vocab_size`` the tokenizer's, used when
    ``section.vocab_size`` is 0."""
    kind = section_kind(section)
    return kind.describe(kind.from_section(section, vocab_size))


def section_values(m: Any, config_type: type, skip: tuple[str, ...] = ()) -> dict:
    """``config_type``'s dataclass fields from section ``m``'s fields of the same names:
    0 is None where the field's default is None (TOML has no None), a list a tuple where
    the default is a tuple."""
    out = {}
    for f in fields(config_type):
        if f.name in skip:
            continue
        value = getattr(m, f.name)
        if f.default is None and not isinstance(value, bool) and value == 0:
            value = None
        elif isinstance(f.default, tuple) and isinstance(value, list):
            value = tuple(value)
        out[f.name] = value
    return out
