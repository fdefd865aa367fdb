"""What the planner plans for: a decoder-only transformer's sizes, named or read from a TOML.

``ModelSpec`` holds the sizes the memory and time formulas need (layers L, width h, heads
a, vocabulary V, sequence s, tied embeddings, biases; key/value heads and the MLP width).
Two families:

- ``"gpt"``: shardwise's own GPT (``models.gpt``): pre-LayerNorm blocks with separate Q, K,
  V, output projections (no key bias), a 4h GELU MLP and learned positions;
- ``"llama"``: ``models.llama``: pre-RMSNorm blocks, grouped-query attention (``n_kv_heads``
  K and V heads of width h / a), a SwiGLU MLP of width f (gate, up, down: 3 h f), rotary
  positions (no parameters), no biases, head untied unless said.

Named sizes (``NAMED``), each a ``[model]`` section of its kind (``gpt_section``,
``llama_section``, ``gemma_section``; ``base.model_config``) whose spec is
``ModelSpec.from_section`` (counted by formula) or, for a Gemma or a DeepSeek,
``from_description`` (built on meta):

- GPT-2 (Radford et al. 2019, Table 2; vocab 50257, context 1024);
- GPT-3 (Brown et al. 2020, Table 2.1; context 2048; 13B's width 5140 rounded to 5120 so
  that the 40 heads divide it);
- Megatron-LM's weak-scaling series (Narayanan et al. SC 2021, Table 1: 1.7B ... 1T,
  vocab 51200, context 2048), which ``benchmarks/planner_published.py`` predicts;
- Llama: TinyLlama 1.1B (Zhang et al. 2024, arXiv:2401.02385, sec. 2.2), Llama 2 7B/13B/70B
  (Touvron et al. 2023, arXiv:2307.09288, Table 1; sizes of the released config.json),
  Llama 3 8B/70B/405B (Grattafiori et al. 2024, arXiv:2407.21783, Table 3; context 8192, the
  pre-training length: Llama 3.1's 128K is ``--seq 131072``);
- Mistral 7B (Jiang et al. 2023, arXiv:2310.06825, Table 1: 32 layers, width 4096, 32
  heads of 128, 8 key/value heads, SwiGLU width 14336, vocabulary 32000, context 8192, a
  sliding window of 4096 tokens on every layer: ``attention_windows``, its attention FLOPs
  counted against 4096 keys a query, not the whole sequence; ``--seq 32768`` is
  v0.1's config.json context);
- mixture of experts: Mixtral 8x7B (Jiang et al. 2024, arXiv:2401.04088, Table 1: 32
  layers, width 4096, 32 heads, 8 key/value heads, 8 SwiGLU experts of width 14336, top-2,
  vocabulary 32000, context 32768; rotary base 1e6 from the released config.json): 46.7B
  parameters, 12.9B active per token. The planner searches expert parallelism (ep) only
  for such a model;
- Phi: Phi-3-mini (Abdin et al. 2024, arXiv:2404.14219: 3.8B, 32 layers, width 3072, 32
  heads, vocabulary 32064; its 4k config.json: 32 key/value heads, SwiGLU width 8192,
  context 4096) and Phi-4 (Abdin et al. 2024, arXiv:2412.08905: 14B, phi-3-medium's 40
  layers of width 5120 and 40 heads, vocabulary 100352; its config.json: 10 key/value
  heads, SwiGLU width 17920, context 16384, rotary base 250000): 3.82B and 14.66B parameters
  (the report's "14B" rounded down; ``transformers.Phi3ForCausalLM`` of those sizes counts
  the same). Phi-3-mini-4k's sliding window of 2047 tokens is on every layer
  (``attention_windows``, as Mistral 7B's: a query counted against min(T, 2047) keys); Phi-4
  has none;
- Gemma: Gemma 2 2B, 9B and 27B (Gemma Team 2024, arXiv:2408.00118, Table 1) and Gemma 3 1B,
  12B and 27B's text towers (Gemma Team 2025, arXiv:2503.19786, Table 1), each with the
  sizes of its released config.json (``google/gemma-2-2b``, ``-9b``, ``-27b``,
  ``google/gemma-3-1b-pt``, ``-12b-pt``, ``-27b-pt``'s ``text_config``; written in
  ``_GEMMA_SIZES``, its options and soft caps its arch's, ``models.hf.arch.OPTIONS``): heads of 256
  (27B: 128) whatever h / a is, tied embeddings of 256000 (Gemma 3: 262144 / 262208)
  tokens, sandwich norms, a window on every other layer (Gemma 2: 4096) or on five of
  every six (Gemma 3: 512 for 1B, 1024 above). These are described specs
  (``from_description`` of the ``models.llama.LlamaConfig`` shardwise trains, built on first
  use: ``NAMED`` builds them lazily), so their parameters are counted on meta (2.61B,
  9.24B, 27.23B, 1.00B, 11.77B, 27.01B; ``tests/test_llama_planner.py`` checks each against
  ``transformers``' model of the same config.json on the meta device), their FLOPs with
  the attention width H D of their own head_dim and each layer's window. Gemma 2's
  soft-capped scores, which the engine writes out (B, H, T, T) on every layer, are priced
  as such (``written_scores``: 8 bytes per head, query and key kept in bf16, and their
  reads and writes): at s = 8192 they dominate a Gemma 2's activations (gemma2-9b at
  tp = 8: 42 of 59 GiB per micro-batch of one sequence). Not priced: the sandwich norms' two
  more norms a block in the memory-bound time and the activations (``simulate.block_ops`` and
  ``memory.activation_bytes`` count a Llama block's two), a few percent of a block's
  activations.
- DeepSeek: DeepSeek-V2-Lite (DeepSeek-AI 2024, arXiv:2405.04434, appendix B; its
  config.json: 27 layers, width 2048, 16 heads, MLA with a key/value latent of 512 and no
  query latent, heads of 128 + 64 rotated features, values of 128, the first block dense of
  10944, then 64 experts of 1408, top 6, 2 shared, vocabulary 102400): 15.7B parameters;
  DeepSeek-V3 (arXiv:2412.19437, sec. 4.2; its config.json: 61 layers, width 7168, 128 heads,
  a query latent of 1536, the first 3 blocks dense of 18432, then 256 experts of 2048 in 8
  groups (4 kept), top 8, 1 shared, routed scaling 2.5, vocabulary 129280): 671.0B
  parameters, 37.6B a token meets (the paper's 37B activated), its multi-token-prediction
  module not counted (transformers' ``DeepseekV3ForCausalLM`` has none; both counts equal
  it on meta). Both described (``ModelSpec.from_description`` of the Llama with MLA, on
  first use), at context 4096 (YaRN's original length; the released configs' YaRN changes no
  size and is left out). No context parallelism (MLA: ``search.cp_reason``).

A TOML model file is a ``shardwise train`` config (or its ``[model]`` table alone): the
model it trains is read as train reads it (``describe_config``: ``model.kind``'s
``ModelDescription``, gpt, llama or a kind registered with ``shardwise.register_model``; the
vocabulary the tokenizer's when ``model.vocab_size`` is 0), and ``ModelSpec.from_description``
takes its sizes, its parameters counted on the meta device, and what tp must divide. Such a
spec keeps its description: the planner's memory counts then come from the model itself
(``described_layers``: each layer's parameters, tp-sharded on meta), not from the closed
forms of the named families.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from shardwise.base.model_config import GPTModelConfig, LlamaModelConfig


class SpecError(ValueError):
    """A model or cluster description the planner cannot use; one line naming the field."""


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of one decoder. ``params`` is the exact parameter count of shardwise's model
    of that family (counted on meta, ``n_params``, for a spec made ``from_description``).
    ``n_kv_heads`` None: ``n_head`` (multi-head attention); ``ffn_hidden`` None: 4h (the
    GPT's MLP). ``family``: the model kind ("gpt", "llama", a registered one).
    ``rope_theta``: the Llama's rotary base (written by ``plan --emit-toml``).
    ``attention_width``: H D of the attention's s^2 terms and Q/K/V widths (None: h, as the
    GPT and Llama; other with a Llama's ``head_dim`` of its own, Qwen3's).
    ``description``: the ``ModelDescription`` a spec was made from (None for the named
    sizes: ``model()`` builds it from the sizes); ``tp_divides``: its sizes tp must divide.
    ``n_experts`` > 0: every block's MLP is a mixture of that many SwiGLU experts of width
    ``moe_ffn_hidden`` (None: ``ffn_hidden``), each token routed to ``top_k`` of them
    (``models.moe``; a router of E x h weights, replicated over tp); ``moe_shared_ffn`` > 0:
    each mixture also has a shared SwiGLU expert of that width every token goes through
    (3 h F_s weights, split over tp as a dense MLP), with ``moe_shared_gate`` its sigmoid
    gate (h weights, replicated over tp: Qwen2-MoE). ``dropout``: the
    model's dropout probability (``model.dropout``; 0 for the named sizes): the engine
    refuses context parallelism (cp > 1) when it is > 0, ring attention having no attention
    dropout, so the search prunes every such layout (``search.cp_reason``).
    ``attention_windows``: per block, its sliding window W in tokens or None (() : none
    has one; ``ModelDescription.attention_windows``): a query's attention FLOPs count
    min(s, W) keys (``attn_keys``). ``dense_layers``: with ``n_experts``, the blocks (from
    0) whose MLP is a dense SwiGLU of width ``ffn_hidden`` instead (the Llama's
    ``dense_layers``: DeepSeek's first_k_dense_replace); parameters are counted block by
    block, and the per-block prices (FLOPs, seconds) are the mean block's (``block``).
    ``block``: which block the per-block quantities describe: "" the model's (every block
    alike, or with ``dense_layers`` the mean over its blocks), "moe" a block with the
    mixture, "dense" one with the dense MLP (``part``). ``written_scores``: the description's
    (``ModelDescription.written_scores``; 0: a fused attention kernel): at cp = 1 the
    attention's s x s scores are counted in activation memory (``memory.shardwise_model``)
    and in its memory-bound time (``simulate.block_ops``). ``latent_attention``: DeepSeek's
    multi-head latent attention (``models.mla``), its config's ``(q_lora_rank or 0,
    kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)``; () without.
    ``attention_mask``: the description's (``model.attention_mask``): "block_causal" keeps
    a token within its document, by a mask (priced: ``planner.attention``).
    ``sandwich_norm``: Gemma 2 and 3's two more RMSNorms a block (on the attention's and
    the MLP's outputs; the config's ``sandwich_norm``), priced in memory and time."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    block_size: int
    tie_weights: bool = True
    bias: bool = True
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    family: str = "gpt"  # "gpt", "llama" (module docstring) or a registered kind
    rope_theta: float = 10000.0
    n_params: int | None = None
    attention_width: int | None = None
    tp_divides: tuple[tuple[str, int], ...] = ()
    description: Any = field(default=None, compare=False, repr=False)
    n_experts: int = 0
    top_k: int = 2
    moe_ffn_hidden: int | None = None
    dropout: float = 0.0
    moe_shared_ffn: int = 0
    moe_shared_gate: bool = False
    attention_windows: tuple[int | None, ...] = ()
    dense_layers: tuple[int, ...] = ()
    block: str = ""
    written_scores: int = 0
    latent_attention: tuple[int, ...] = ()
    attention_mask: str = "causal"
    sandwich_norm: bool = False
    lora: tuple = ()  # (rank, targets) of a run's [lora] with rank > 0: only adapters train
    dense_share: float = -1.0  # set from dense_layers; kept by replace(spec, n_layer=1)

    def __post_init__(self):
        if self.dense_share < 0:
            object.__setattr__(self, "dense_share", len(self.dense_layers) / self.n_layer)

    @classmethod
    def from_section(cls, m, name: str) -> ModelSpec:
        """The spec of a GPT's or a plain Llama's ``[model]`` section
        (``base.model_config.GPTModelConfig`` / ``LlamaModelConfig``: a named size), counted
        by formula, nothing built: sizes, tied head, biases (the GPT's ``bias``; the Llama
        has none), key/value heads and SwiGLU width (0: unset), rotary base, experts and
        their top-k, and ``sliding_window`` on every layer. A section with more options (a
        Gemma's, latent attention) is ``from_description``'s."""
        sizes = (name, m.n_layer, m.n_embd, m.n_head, m.vocab_size, m.block_size)
        if m.kind == "gpt":
            return cls(*sizes, tie_weights=m.tie_weights, bias=m.bias)
        return cls(*sizes, tie_weights=m.tie_weights, bias=False,
                   n_kv_heads=m.n_kv_heads or None, ffn_hidden=m.ffn_hidden or None,
                   family=m.kind, rope_theta=m.rope_theta, n_experts=m.n_experts,
                   top_k=m.top_k,
                   attention_windows=(m.sliding_window,) * m.n_layer if m.sliding_window
                   else ())

    @classmethod
    def from_description(cls, d, name: str | None = None) -> ModelSpec:
        """The spec of a ``models.description.ModelDescription`` (or a registered config):
        sizes from the description (layers, width, vocabulary, sequence, tied, experts),
        heads, key/value heads, MLP width, rotary base and the experts' top-k and width from
        its config where it has those fields (``n_head`` 1 otherwise: only the activations'
        small log-sum-exp term reads it), a shared expert's width and gate from its
        ``moe_shared_expert``, ``moe_shared_ffn_hidden`` and ``moe_shared_expert_gate``,
        ``dropout`` from its config's ``dropout`` (0 without one), biases and the parameter
        count from the model built on the meta device, ``family`` its kind. Raises
        ``ValueError`` for a model the planner cannot read."""
        from torch import nn

        from shardwise.models.description import describe

        d = describe(d)
        model = _meta_model(d)
        cfg = d.config
        shared = d.n_experts > 0 and getattr(cfg, "moe_shared_expert", False)
        bias = any(m.bias is not None for m in model.modules() if isinstance(m, nn.Linear))
        return cls(name or d.kind, d.n_layer, d.hidden_size, getattr(cfg, "n_head", None) or 1,
                   d.vocab_size, d.block_size, tie_weights=d.tied is not None, bias=bias,
                   n_kv_heads=getattr(cfg, "n_kv_heads", None),
                   ffn_hidden=getattr(cfg, "ffn_hidden", None), family=d.kind,
                   rope_theta=float(getattr(cfg, "rope_theta", 10000.0)),
                   n_params=sum(p.numel() for p in model.parameters()),
                   attention_width=d.attention_width,
                   tp_divides=tuple(d.tp_divides.items()), description=d,
                   n_experts=d.n_experts,
                   top_k=getattr(cfg, "top_k", 2) or 2,
                   moe_ffn_hidden=getattr(cfg, "moe_ffn_hidden", None) or None,
                   dropout=float(getattr(cfg, "dropout", 0.0) or 0.0),
                   moe_shared_ffn=(getattr(cfg, "moe_shared_ffn_hidden", None)
                                   or getattr(cfg, "moe_ffn_hidden", None) or 0) if shared else 0,
                   moe_shared_gate=bool(shared and getattr(cfg, "moe_shared_expert_gate", False)),
                   attention_windows=tuple(d.attention_windows),
                   dense_layers=tuple(getattr(cfg, "dense_layers", ()) or ())
                   if d.n_experts else (), written_scores=d.written_scores,
                   latent_attention=tuple(getattr(cfg, k) or 0 for k in (
                       "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                       "v_head_dim")) if getattr(cfg, "kv_lora_rank", 0) else (),
                   attention_mask=d.attention_mask,
                   sandwich_norm=bool(getattr(cfg, "sandwich_norm", False)))

    def section(self):
        """These sizes as a run's ``[model]`` section (``base.config.ModelConfig``, kind
        ``family``): what ``model_table`` writes and ``model()`` describes."""
        from shardwise.base.config import ModelConfig

        return ModelConfig(**self.model_table())

    def model_table(self) -> dict:
        """The ``[model]`` table of a train config for these sizes (``plan --emit-toml``):
        the GPT's fields, or the Llama's (kind, key/value heads, SwiGLU width, rotary base,
        experts and a shared expert's width and gate; ``head_dim``; every other field of
        the Llama's section its description's config sets to another value than the
        section's default (``_config_options``); ``sliding_window``
        and, when not every block has it, ``layer_types``, from ``attention_windows``);
        ``dropout`` when it is not 0, ``attention_mask`` when it is not "causal"."""
        t = {"kind": self.family, "n_layer": self.n_layer, "n_head": self.n_head,
             "n_embd": self.n_embd, "block_size": self.block_size,
             "vocab_size": self.vocab_size, "tie_weights": self.tie_weights,
             **({"dropout": self.dropout} if self.dropout else {}),
             **({"attention_mask": self.attention_mask}
                if self.attention_mask != "causal" else {})}
        if self.family == "gpt":
            return {**t, "bias": self.bias}
        moe = ({"n_experts": self.n_experts, "top_k": self.top_k,
                "moe_ffn_hidden": self.expert_ffn} if self.moe else {})
        if self.moe and self.moe_shared_ffn:
            moe.update(moe_shared_expert=True, moe_shared_ffn_hidden=self.moe_shared_ffn,
                       moe_shared_expert_gate=self.moe_shared_gate)
        if self.moe and self.dense_layers:
            moe["dense_layers"] = list(self.dense_layers)
        cfg = getattr(self.description, "config", None)
        qwen = _config_options(cfg)
        windows = {w for w in self.attention_windows if w is not None}
        if windows:  # one W (model.sliding_window) on the layers layer_types marks
            qwen["sliding_window"] = windows.pop()
            if None in self.attention_windows and len(self.attention_windows) == self.n_layer:
                qwen["layer_types"] = ["full_attention" if w is None else "sliding_attention"
                                       for w in self.attention_windows]
        # a head's width: its config's (MLA: the keys', nope + rope; attn_width is the mean
        # of the keys' and the values'), or H D / H
        head = getattr(cfg, "head_dim", None) or self.attn_width // self.n_head
        if head * self.n_head != self.n_embd:
            qwen["head_dim"] = head
        return {**t, "n_kv_heads": self.kv_heads, "ffn_hidden": self.ffn,
                "rope_theta": float(self.rope_theta), **moe, **qwen}

    def model(self):
        """The ``ModelDescription`` of this spec: its own, or the registered kind
        ``family`` built from ``section()`` (the engine's model of these sizes)."""
        if self.description is not None:
            return self.description
        from shardwise.models.description import describe_section

        return describe_section(self.section(), self.vocab_size)

    @property
    def attn_width(self) -> int:
        """H D, the width of the attention's Q K^T and P V (``attention_width`` or h)."""
        return self.n_embd if self.attention_width is None else self.attention_width

    @property
    def attn_keys(self) -> float:
        """Keys a query's Q K^T and P V are counted against, averaged over the blocks: s
        (the causal triangle counted whole, as PaLM does), or min(s, W) for a block with a
        sliding window of W (``models.description.ModelDescription.attention_keys`` / L)."""
        s, windows = self.block_size, self.attention_windows
        if not windows:
            return s
        # over the windows' own count: a one-block spec cut from this one (a calibration
        # block, ``replace(spec, n_layer=1)``) keeps the average
        return sum(s if w is None else min(s, w) for w in windows) / len(windows)

    @property
    def attention_calls(self):
        """The engine's attention calls at cp = 1 (``planner.attention.attention_calls``:
        the keys a query is priced against, the scores written, the masks kept)."""
        from shardwise.planner.attention import attention_calls

        return attention_calls(self.block_size, self.attention_windows,
                               self.attention_mask == "block_causal", self.written_scores > 0)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_head

    @property
    def ffn(self) -> int:
        """MLP width f: ``ffn_hidden``, or 4h."""
        return self.ffn_hidden or 4 * self.n_embd

    @property
    def moe(self) -> bool:
        """A mixture of experts (``n_experts`` > 0), in every block but ``dense_layers``
        (none in the part ``block = "dense"``)."""
        return self.n_experts > 0 and self.block != "dense"

    @property
    def mixed(self) -> bool:
        """Blocks of both kinds whose per-block quantities are their mean (``block`` "")."""
        return self.moe and bool(self.dense_layers) and not self.block

    def is_moe_block(self, i: int) -> bool:
        """Whether block ``i`` (from 0) holds the mixture."""
        return self.n_experts > 0 and i not in self.dense_layers

    @property
    def moe_share(self) -> float:
        """The fraction of the blocks that hold the mixture (1 or 0 for a part)."""
        if not self.moe:
            return 0.0
        return 1.0 if self.block else 1.0 - self.dense_share

    def part(self, block: str) -> ModelSpec:
        """These sizes with the per-block quantities of a block of kind ``block`` ("moe"
        or "dense")."""
        return replace(self, block=block)

    @property
    def expert_ffn(self) -> int:
        """Each expert's SwiGLU width F: ``moe_ffn_hidden``, or ``ffn``."""
        return self.moe_ffn_hidden or self.ffn

    @property
    def expert_params(self) -> int:
        """Weights of one block's experts, unsharded: E x 3 h F (gate, up, down); 0 dense."""
        return self.n_experts * 3 * self.n_embd * self.expert_ffn if self.moe else 0

    @property
    def shared_expert_params(self) -> int:
        """Weights of one block's shared expert, 3 h F_s, and its gate, h (0 without)."""
        if not (self.moe and self.moe_shared_ffn):
            return 0
        return 3 * self.n_embd * self.moe_shared_ffn + self.shared_gate_params

    @property
    def shared_gate_params(self) -> int:
        """Weights of one block's shared-expert gate: h (replicated over tp), or 0."""
        return self.n_embd if self.moe and self.moe_shared_ffn and self.moe_shared_gate else 0

    @property
    def gated(self) -> bool:
        """SwiGLU (three h x f matrices) rather than GELU (two)."""
        return self.family == "llama"

    @property
    def pos_params(self) -> int:
        """Learned position embedding (GPT: s h); rotary positions have none."""
        return 0 if self.family == "llama" else self.block_size * self.n_embd

    @property
    def params(self) -> int:
        """Parameters of the unsharded model (tied head counted once)."""
        if self.n_params is not None:
            return self.n_params
        L, h, V = self.n_layer, self.n_embd, self.vocab_size
        if self.mixed:
            n = sum(1 for i in self.dense_layers if i < L)
            blocks = ((L - n) * block_params(h, self.bias, self.part("moe"))
                      + n * block_params(h, self.bias, self.part("dense")))
        else:
            blocks = L * block_params(h, self.bias, self)
        return V * h + self.pos_params + blocks + head_params(self)

    def with_seq(self, seq: int) -> ModelSpec:
        """These sizes at sequence length ``seq`` (a described model is described again
        from its config with ``block_size = seq``: a learned position table grows with it;
        its ``dropout`` is kept)."""
        if self.description is None:
            return replace(self, block_size=seq)
        from shardwise.models.description import describe

        cfg = self.description.config
        if not (dataclasses.is_dataclass(cfg) and hasattr(cfg, "block_size")):
            raise SpecError(f"--seq: the config of model.kind={self.family!r} has no "
                            "block_size field; set the sequence in the model's config")
        spec = ModelSpec.from_description(describe(dataclasses.replace(cfg, block_size=seq)),
                                          name=self.name)
        return replace(spec, dropout=self.dropout)


# the Llama section's fields model_table writes from the spec's own sizes (or not at all:
# the attention kernel), not from its description's config
_FROM_THE_SPEC = ("kind", "module", "init_from", "n_layer", "n_head", "n_embd", "block_size",
                  "vocab_size", "tie_weights", "dropout", "attention", "attention_mask",
                  "n_kv_heads", "ffn_hidden", "rope_theta", "n_experts", "top_k",
                  "moe_ffn_hidden", "moe_shared_expert", "moe_shared_ffn_hidden",
                  "moe_shared_expert_gate", "dense_layers", "sliding_window", "layer_types",
                  "head_dim")


def _config_options(cfg) -> dict:
    """The ``[model]`` fields of the Llama's section (``base.model_config.LlamaModelConfig``)
    that config ``cfg`` sets to another value than the section's default, besides those
    the spec writes itself (``ModelSpec.model_table``): a rotary scaling as its table, a
    tuple as a list, None (unset) left out; {} for no config."""
    from shardwise.base.model_config import LlamaModelConfig

    if cfg is None:
        return {}
    out = {}
    for name, info in LlamaModelConfig.model_fields.items():
        if name in _FROM_THE_SPEC or getattr(cfg, name, None) is None:
            continue
        value = getattr(cfg, name)
        if name == "rope_scaling" and not isinstance(value, dict):
            kind = ("longrope" if hasattr(value, "short_factor") else
                    "llama3" if hasattr(value, "low_freq_factor") else
                    "yarn" if hasattr(value, "beta_fast") else "linear")
            value = {"rope_type": kind, **{k: list(v) if isinstance(v, tuple) else v
                                           for k, v in dataclasses.asdict(value).items()}}
        value = list(value) if isinstance(value, tuple) else value
        if value != info.get_default(call_default_factory=True):
            out[name] = value
    return out


def block_matmul_params(spec: ModelSpec) -> int:
    """Weights of one block's matrices: Q and output h^2 each, K and V h * kv_heads * h/a
    each, the MLP 2 h f (GELU) or 3 h f (SwiGLU), or with experts the router E h and every
    expert's 3 h F (and a shared expert's 3 h F_s, its gate h). GPT: 12 h^2. A spec with a
    description: its first block's (of kind ``spec.block``, when set)
    ``nn.Linear`` weights and experts, counted on meta. Mixed blocks (``ModelSpec.mixed``):
    the mean over the blocks (a float)."""
    if spec.mixed:
        m = spec.moe_share
        return (m * block_matmul_params(spec.part("moe"))
                + (1 - m) * block_matmul_params(spec.part("dense")))
    if spec.description is not None:
        d = described_layers(spec, 1)
        if not d.block_matmuls:
            return 0
        first = 0
        if spec.block:
            first = next(i for i in range(len(d.block_matmuls))
                         if spec.is_moe_block(i) == (spec.block == "moe"))
        return d.block_matmuls[first]
    h = spec.n_embd
    kv = spec.kv_heads * (h // spec.n_head)
    if spec.moe:
        return (2 * h * h + 2 * h * kv + spec.n_experts * h + spec.expert_params
                + spec.shared_expert_params)
    return 2 * h * h + 2 * h * kv + (3 if spec.gated else 2) * h * spec.ffn


def active_matmul_params(spec: ModelSpec) -> int:
    """Weights one token meets in a block, the ones its forward FLOPs count (2 each):
    ``block_matmul_params``, with experts only the ``top_k`` a token is routed to (Mixtral
    8x7B: 12.9B active of 46.7B; Jiang et al. 2024), and a shared expert and its gate
    whole (every token goes through them)."""
    if spec.mixed:
        m = spec.moe_share
        return (m * active_matmul_params(spec.part("moe"))
                + (1 - m) * active_matmul_params(spec.part("dense")))
    if not spec.moe:
        return block_matmul_params(spec)
    h, F = spec.n_embd, spec.expert_ffn
    return (block_matmul_params(spec) - spec.expert_params
            + spec.top_k * 3 * h * F)


def block_params(h: int, bias: bool = True, spec: ModelSpec | None = None) -> int:
    """One transformer block. GPT (``spec`` None or a GPT spec with a 4h MLP): Q, K, V,
    output (4h^2; biases on Q, V, out), MLP (8h^2; biases 4h + h), two LayerNorms (2h each
    with bias, h without). Otherwise ``block_matmul_params`` + the biases (Q, V, out; the
    MLP's f, or 2f gated, + h) when ``bias`` + two norms."""
    b = 1 if bias else 0
    if spec is None or (not spec.gated and spec.ffn == 4 * h and spec.kv_heads == spec.n_head):
        return 12 * h * h + b * (3 * h + 5 * h) + 2 * (2 * h if bias else h)
    kv = spec.kv_heads * (h // spec.n_head)
    biases = b * (h + kv + h + (2 if spec.gated else 1) * spec.ffn + h)
    return block_matmul_params(spec) + biases + 2 * (2 * h if bias else h)


def head_params(spec: ModelSpec) -> int:
    """Final norm, plus the projection when it is not tied to the embedding."""
    ln = 2 * spec.n_embd if spec.bias else spec.n_embd
    return ln + (0 if spec.tie_weights else spec.vocab_size * spec.n_embd)


def gpt_section(L, h, a, V, s) -> GPTModelConfig:
    """A named GPT's ``[model]`` section: layers, hidden, heads, vocabulary, context."""
    return GPTModelConfig(n_layer=L, n_embd=h, n_head=a, vocab_size=V, block_size=s)


def llama_section(L, h, a, kv, f, V, s, theta=10000.0, experts=0, top_k=2,
                  window=0) -> LlamaModelConfig:
    """A named Llama's ``[model]`` section: layers, hidden, heads, key/value heads, SwiGLU
    width, vocabulary, context, rotary base, experts and their top-k, a window on every
    layer (0: none); untied."""
    return LlamaModelConfig(kind="llama", n_layer=L, n_embd=h, n_head=a, n_kv_heads=kv,
                            ffn_hidden=f, vocab_size=V, block_size=s, rope_theta=theta,
                            n_experts=experts, top_k=top_k, sliding_window=window,
                            tie_weights=False)


def _m(name, *sizes) -> ModelSpec:
    return ModelSpec.from_section(gpt_section(*sizes), name)


def _llama(name, *sizes, **options) -> ModelSpec:
    return ModelSpec.from_section(llama_section(*sizes, **options), name)


def _deepseek(name: str, L: int, h: int, a: int, f: int, V: int, s: int, experts: int,
              top_k: int, expert_f: int, shared: int, dense: int, groups: int, kept: int,
              scaling: float, q_rank: int, v3: bool) -> ModelSpec:
    """A DeepSeek as shardwise's Llama (``models.mla``, ``models.moe``; ``models.hf``'s
    DeepSeek archs read a config.json so): multi-head latent attention with a key/value
    latent of 512, heads of 128 + 64 rotated features and values of 128 (both models), a
    query latent of ``q_rank`` (0: none), the first ``dense`` blocks dense, ``shared``
    shared experts as one SwiGLU. Described (built on meta: counted as the engine builds
    it), at the default rotary: the released configs' YaRN changes no size; its
    ``[model]`` section a ``LlamaModelConfig``."""
    from shardwise.models.description import describe_section

    section = LlamaModelConfig(
        kind="llama", vocab_size=V, block_size=s, n_layer=L, n_head=a, n_embd=h, ffn_hidden=f,
        norm_eps=1e-6, tie_weights=False, n_experts=experts, top_k=top_k,
        moe_ffn_hidden=expert_f, moe_gating="sigmoid" if v3 else "softmax", moe_norm_topk=v3,
        moe_n_group=groups, moe_topk_group=kept, moe_group_score="top2" if v3 else "top1",
        moe_routed_scaling=scaling, moe_shared_expert=True,
        moe_shared_ffn_hidden=shared * expert_f, moe_expert_bias=v3,
        dense_layers=list(range(dense)), kv_lora_rank=512, q_lora_rank=q_rank,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True)
    return ModelSpec.from_description(describe_section(section, V), name=name)


class _Named(dict):
    """``NAMED``: name -> ``ModelSpec``, a value given as a function built on first use (the
    described DeepSeeks and Gemmas: each counts its parameters on the meta device, 0.3 to
    1 s, which an ``import`` should not pay)."""

    def __getitem__(self, name: str) -> ModelSpec:
        v = super().__getitem__(name)
        if callable(v):
            v = v()
            super().__setitem__(name, v)
        return v

    def get(self, name, default=None):
        try:
            return self[name]
        except KeyError:
            return default

    def values(self):
        return [self[k] for k in self]

    def items(self):
        return [(k, self[k]) for k in self]


NAMED: dict[str, ModelSpec] = _Named({m.name: m for m in [
    _m("gpt2-124m", 12, 768, 12, 50257, 1024),
    _m("gpt2-350m", 24, 1024, 16, 50257, 1024),
    _m("gpt2-774m", 36, 1280, 20, 50257, 1024),
    _m("gpt2-1.5b", 48, 1600, 25, 50257, 1024),
    _m("gpt3-2.7b", 32, 2560, 32, 50257, 2048),
    _m("gpt3-6.7b", 32, 4096, 32, 50257, 2048),
    _m("gpt3-13b", 40, 5120, 40, 50257, 2048),
    _m("gpt3-175b", 96, 12288, 96, 50257, 2048),
    # Narayanan et al. 2021, Table 1 (heads, hidden, layers)
    _m("megatron-1.7b", 24, 2304, 24, 51200, 2048),
    _m("megatron-3.6b", 30, 3072, 32, 51200, 2048),
    _m("megatron-7.5b", 36, 4096, 32, 51200, 2048),
    _m("megatron-18b", 40, 6144, 48, 51200, 2048),
    _m("megatron-39b", 48, 8192, 64, 51200, 2048),
    _m("megatron-76b", 60, 10240, 80, 51200, 2048),
    _m("megatron-146b", 80, 12288, 96, 51200, 2048),
    _m("megatron-310b", 96, 16384, 128, 51200, 2048),
    _m("megatron-530b", 105, 20480, 128, 51200, 2048),
    _m("megatron-1t", 128, 25600, 160, 51200, 2048),
    # name, layers, hidden, heads, kv heads, FFN width, vocab, context (, rotary base: the
    # released config.json's rope_theta, 500000 for Llama 3)
    _llama("tinyllama-1.1b", 22, 2048, 32, 4, 5632, 32000, 2048),
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, 500000.0),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, 500000.0),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, 500000.0),
    # Jiang et al. 2023, Table 1 (module docstring): a sliding window of 4096 on every layer
    _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 8192, window=4096),
    # Jiang et al. 2024, Table 1 (module docstring): 8 experts, top-2
    _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 32768, 1e6, experts=8, top_k=2),
    # Phi-3-mini (4k) and Phi-4 (module docstring): Llamas in shardwise (models.hf.PHI3);
    # Phi-3-mini-4k's config.json: a sliding window of 2047 on every layer
    _llama("phi3-mini", 32, 3072, 32, 32, 8192, 32064, 4096, window=2047),
    _llama("phi4", 40, 5120, 40, 10, 17920, 100352, 16384, 250000.0),
]}, **{
    # DeepSeek-AI 2024, the released config.json files (module docstring): name, layers,
    # hidden, heads, dense FFN width, vocab, context (4096: YaRN's original; the released
    # 163840 is YaRN's), routed experts, top-k, expert width, shared experts, dense blocks,
    # groups, groups kept, routed scaling, query latent, V3
    "deepseek-v2-lite": lambda: _deepseek("deepseek-v2-lite", 27, 2048, 16, 10944, 102400,
                                          4096, 64, 6, 1408, 2, 1, 1, 1, 1.0, 0, False),
    "deepseek-v3": lambda: _deepseek("deepseek-v3", 61, 7168, 128, 18432, 129280, 4096, 256,
                                     8, 2048, 1, 3, 8, 4, 2.5, 1536, True),
})


# Gemma's released config.json sizes (module docstring): name -> (layers, hidden, heads, kv
# heads, head_dim, FFN width, vocab, context, window, window pattern (every n-th layer
# global), query_pre_attn_scalar, rotary base (global, local), the global layers' linear
# rotary factor); its options and soft caps are its arch's (``gemma_section``)
_GEMMA_SIZES = {
    # google/gemma-2-2b, google/gemma-2-9b config.json (rope_theta 10000, one base)
    "gemma2-2b": (26, 2304, 8, 4, 256, 9216, 256000, 8192, 4096, 2, 256, (1e4, None), None),
    "gemma2-9b": (42, 3584, 16, 8, 256, 14336, 256000, 8192, 4096, 2, 256, (1e4, None), None),
    # google/gemma-2-27b: heads of 128, queries scaled by (h / a)^-1/2 = 144^-1/2
    "gemma2-27b": (46, 4608, 32, 16, 128, 36864, 256000, 8192, 4096, 2, 144, (1e4, None),
                   None),
    # google/gemma-3-1b-pt, -12b-pt, -27b-pt (text_config) config.json; context: 1B's 32768
    # (the pre-training length; 12B and 27B's 131072 is --seq 131072)
    "gemma3-1b": (26, 1152, 4, 1, 256, 6912, 262144, 32768, 512, 6, 256, (1e6, 1e4), None),
    "gemma3-12b": (48, 3840, 16, 8, 256, 15360, 262208, 32768, 1024, 6, 256, (1e6, 1e4),
                   8.0),
    "gemma3-27b": (62, 5376, 32, 16, 128, 21504, 262208, 32768, 1024, 6, 168, (1e6, 1e4),
                   8.0),
}


def gemma_section(name: str):
    """The ``[model]`` section (``base.model_config.LlamaModelConfig``) of the Gemma named
    ``name``: its sizes (``_GEMMA_SIZES``), the options its arch fixes and the soft caps of
    its released config.json, transformers' defaults (``models.hf.arch.OPTIONS``,
    ``SOFT_CAPS``: Gemma 2's scores capped at 50 and logits at 30, Gemma 3's neither)."""
    from shardwise.models.hf.arch import SOFT_CAPS, options

    L, h, a, kv, d, f, V, s, window, every, scalar, (theta, local), factor = _GEMMA_SIZES[name]
    arch = "Gemma2" if name.startswith("gemma2") else "Gemma3"
    return LlamaModelConfig(**{
        **options(arch), **{cap: value or 0.0 for cap, value in SOFT_CAPS[arch].items()},
        "kind": "llama", "vocab_size": V, "block_size": s, "n_layer": L, "n_head": a,
        "n_kv_heads": kv, "n_embd": h, "head_dim": d, "ffn_hidden": f, "norm_eps": 1e-6,
        "rope_theta": theta, "tie_weights": True,
        "rope_scaling": {"rope_type": "linear", "factor": factor} if factor else None,
        "rope_local_base_freq": local or 0.0, "mlp_activation": "gelu_tanh",
        "query_pre_attn_scalar": float(scalar), "sliding_window": window,
        "layer_types": ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                        for i in range(L)]})


def gemma_config(name: str):
    """The ``models.llama.LlamaConfig`` of the Gemma named ``name`` (``gemma_section``)."""
    from shardwise.models.description import describe_section

    return describe_section(gemma_section(name), _GEMMA_SIZES[name][6]).config


def _gemma(name: str):
    def build() -> ModelSpec:
        from shardwise.models.llama import describe

        return ModelSpec.from_description(describe(gemma_config(name)), name=name)
    return build


NAMED = _Named(NAMED, **{name: _gemma(name) for name in _GEMMA_SIZES})

@dataclass(frozen=True)
class DescribedLayers:
    """Parameter elements of a described model's layers on one tp rank (``described_layers``).

    counts: per layer in pipeline order (embedding, blocks, head), tp-sharded, vocabulary
    padded, each layer's own parameters (a tied head counts the embedding's matrix, as its
    ``parameters()`` include it); tied: elements of the tied matrix on that rank (0 if
    untied), counted once when one rank holds both ends; block_matmul: the first block's
    ``nn.Linear`` weights, unsharded (2 per token per weight: its forward FLOPs);
    experts: per layer, the elements of ``counts`` that expert parallelism splits
    (``parallel.experts.is_expert``; all experts, ep = 1); block_matmuls: per block, its
    ``nn.Linear`` weights and experts, unsharded."""

    counts: tuple[int, ...]
    tied: int
    block_matmul: int
    experts: tuple[int, ...] = ()
    block_matmuls: tuple[int, ...] = ()


@lru_cache(maxsize=64)
def described_layers(spec: ModelSpec, tp: int) -> DescribedLayers:
    """``spec.model()`` built as the engine builds it on tp rank 0 of ``tp`` (meta device:
    nothing allocated), its layers counted. Every tp rank holds as many elements (tp
    divides the split sizes; the vocabulary is padded). Raises ``ValueError`` when tp does
    not divide a size (as the engine would)."""
    import torch
    from torch import nn

    from shardwise.engine.model import build_local_model
    from shardwise.parallel.tensor_parallel.group import RankGroup

    d = spec.model()
    with torch.device("meta"):  # one pipeline stage: every layer, as the engine cuts none
        local = build_local_model(d, pp=1, pp_rank=0, chunk_ids=[0], n_chunks=1,
                                  tp=RankGroup(size=tp, rank=0), seed=0, dropout_seed=0,
                                  device=torch.device("meta"))
    from shardwise.parallel.experts import is_expert

    layers = local.chunks[0].layers
    counts = tuple(sum(p.numel() for p in layer.parameters()) for layer in layers)
    def expert_elements(layer) -> int:
        """Its experts' elements: split over ep (``is_expert``), or, built here without
        ep, the stacked weights held directly by modules with ``n_experts`` (``models.moe``'s
        ``Experts``; its ``MoE`` holds none directly, the shared expert is a submodule)."""
        own = sum(p.numel() for m in layer.modules() if hasattr(m, "n_experts")
                  for p in m.parameters(recurse=False))
        return own or sum(p.numel() for p in layer.parameters() if is_expert(p))

    experts = tuple(expert_elements(layer) for layer in layers)
    tied = dict(local.named_parameters())[d.tied[0]].numel() if d.tied is not None else 0
    if tp > 1:
        one = described_layers(spec, 1)
        block_matmul, matmuls = one.block_matmul, one.block_matmuls
    else:
        linear = [sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
                  for layer in layers[1:-1]]
        block_matmul = linear[0] if linear else 0
        matmuls = tuple(n + e for n, e in zip(linear, experts[1:-1]))
    return DescribedLayers(counts, tied, block_matmul, experts, matmuls)


def _meta_model(d):
    import torch

    with torch.device("meta"):
        return d.build()


def describe_config(cfg) -> Any:
    """The ``ModelDescription`` of the model a run's ``Config`` trains, read as ``shardwise
    train`` reads it: ``model.kind``'s (gpt, llama, a registered kind), the vocabulary
    ``model.vocab_size`` or, when 0, the character tokenizer's of ``data.path``. Raises
    ``ValueError`` (one line) for the CNN, an unknown kind or sizes the model refuses
    (``DataError`` for a corpus it cannot read)."""
    from shardwise.models.description import describe_section

    m = cfg.model
    if m.kind == "cnn":
        raise SpecError("model.kind=cnn: the CNN has its own planner (shardwise plan "
                        "--model cnn --config ...)")
    vocab = m.vocab_size
    if not vocab:
        from shardwise.data import CharTokenizer, load_text

        vocab = CharTokenizer.from_text(load_text(cfg.data.path)).vocab_size
    return describe_section(m, vocab)


def full_size(d) -> int:
    """Parameters of the single-process model of description ``d`` (a tied matrix once),
    counted on the meta device."""
    return sum(p.numel() for p in _meta_model(d).parameters())


def load_model(text: str, seq: int | None = None) -> ModelSpec:
    """A named size (``NAMED``), a TOML file (a train config, or its ``[model]`` table
    alone), or ``hf:DIR`` (a Hugging Face checkpoint directory: its config.json only, no
    weights read), described as ``shardwise train`` describes it (``model.init_from``
    resolved from config.json, ``apps.lm.hf.resolve_init_from``; ``describe_config``;
    ``ModelSpec.from_description``). ``seq``: the sequence length (a named size's
    ``with_seq``; a file's or checkpoint's ``model.block_size``, at most a checkpoint's
    context). A file's
    ``dropout`` is its ``model.dropout`` (what the engine's cp check reads), or the model
    config's own when that is 0. ``SpecError`` for anything else, naming the file and the
    field (the config's own one-line errors)."""
    from shardwise.base.config import Config

    if text in NAMED:
        return NAMED[text] if seq is None else NAMED[text].with_seq(seq)
    if text.startswith("hf:"):  # a Hugging Face checkpoint: its config.json alone is read
        where, name = f"--model {text}", Path(text[3:]).expanduser().resolve().name
        data = {"model": {"init_from": text}}
    else:
        path = Path(text)
        if not path.is_file():
            raise SpecError(f"--model {text!r}: neither a named size ({', '.join(NAMED)}), a "
                            "TOML file nor hf:DIR (a Hugging Face checkpoint directory)")
        where, name = str(path), path.stem
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise SpecError(f"{path}: not valid TOML: {exc}") from None
        if "model" not in data:  # a bare [model] table
            data = {"model": data}
        if not isinstance(data["model"], dict):
            raise SpecError(f"{path}: expected a [model] table")
    try:
        from shardwise.apps.lm.hf import resolve_init_from

        # model.init_from: the checkpoint's model, as shardwise train resolves it
        cfg = resolve_init_from(Config.from_dict(data))
        if seq is not None:
            if cfg.model.init_from and seq > cfg.model.block_size:
                raise SpecError(f"--seq {seq}: longer than the checkpoint's "
                                f"{cfg.model.block_size} tokens ({cfg.model.init_from}: its "
                                "config.json)")
            data["model"]["block_size"] = seq
            cfg = resolve_init_from(Config.from_dict(data))
        spec = ModelSpec.from_description(describe_config(cfg), name=name)
        lora = (cfg.lora.rank, tuple(cfg.lora.targets)) if cfg.lora.rank else ()
        return replace(spec, dropout=cfg.model.dropout or spec.dropout, lora=lora)
    except SpecError:
        raise
    except ValueError as exc:  # ConfigError, DataError, a model's own size checks
        raise SpecError(f"{where}: {exc}") from None


def positive_number(text: str, flag: str, integer: bool = False) -> float:
    """Parse a size given on the command line: finite, > 0 (whole with ``integer``)."""
    try:
        value = float(text)
    except ValueError:
        raise SpecError(f"{flag} {text!r}: expected a number") from None
    if not math.isfinite(value) or value <= 0 or (integer and value != int(value)):
        raise SpecError(f"{flag} {text!r}: expected a finite {'whole ' if integer else ''}"
                        "number > 0")
    return int(value) if integer else value
