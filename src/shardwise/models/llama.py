"""Llama-family decoder from separable building blocks (single-process reference).

Token embedding (no learned positions), ``n_layer`` pre-RMSNorm blocks (causal
grouped-query self-attention with rotary position embeddings, then a SwiGLU MLP, each
inside a residual), a final RMSNorm and an LM head, tied to the embedding or not; no
biases anywhere. Sources:

- Touvron et al. 2023, "LLaMA" (arXiv:2302.13971): RMSNorm pre-normalisation, SwiGLU,
  rotary embeddings, the FFN width ``8h/3`` rounded up to ``multiple_of``;
- Su et al. 2021, "RoFormer" (arXiv:2104.09864): rotary position embeddings, here in the
  Hugging Face "rotate_half" layout (the two halves of a head are the pair rotated
  together), so weights map 1:1 onto ``transformers.LlamaForCausalLM``;
- Shazeer 2020, "GLU Variants Improve Transformer" (arXiv:2002.05202): SwiGLU;
- Ainslie et al. 2023, "GQA" (arXiv:2305.13245): ``n_kv_heads`` key/value heads, each
  shared by ``n_head / n_kv_heads`` query heads;
- Grattafiori et al. 2024, "The Llama 3 Herd of Models" (arXiv:2407.21783): the rotary
  frequency scaling for long context (``RopeScaling``);
- Yang et al. 2024, "Qwen2 Technical Report" (arXiv:2407.10671) and transformers'
  ``models/qwen2/modeling_qwen2.py``: biases on the Q, K and V projections (``qkv_bias``);
- Beltagy et al. 2020, "Longformer" (arXiv:2004.05150) and Jiang et al. 2023, "Mistral 7B"
  (arXiv:2310.06825): sliding-window attention, each query attending to the previous
  ``sliding_window`` tokens (its own included), on every layer or on those ``layer_types``
  marks "sliding_attention" (transformers' names: Qwen2's ``max_window_layers`` pattern);
- Yang et al. 2025, "Qwen3 Technical Report" (arXiv:2505.09388) and transformers'
  ``models/qwen3/modeling_qwen3.py``: QK-norm, an RMSNorm over each head's D features of
  Q and of K before the rotary embedding (``qk_norm``), and a head dimension D that need
  not be h / n_head (``head_dim``);
- Abdin et al. 2024, "Phi-3 Technical Report" (arXiv:2404.14219) and transformers'
  ``models/phi3/modeling_phi3.py``: partial rotary embeddings, only the first
  ``rotary_dim`` of each head's D features rotated (``partial_rotary_factor``: Phi-4-mini's
  0.75), the rest passed through; Ding et al. 2024, "LongRoPE" (arXiv:2402.13753): the
  per-frequency rescaling of the 128k Phi models (``LongRope``), its short factors;
- Gemma Team 2024, "Gemma" (arXiv:2403.08295), "Gemma 2" (arXiv:2408.00118) and "Gemma 3"
  (arXiv:2503.19786), with transformers' ``models/gemma{,2,3}/modeling_gemma*.py``: RMSNorm
  weights stored zero-centred, scaling by 1 + w (``norm_zero_centered``), the embedding
  scaled by sqrt(h) (``scale_embedding``), GeGLU (``mlp_activation = "gelu_tanh"``), norms
  around each sublayer's output too (``sandwich_norm``), the scores scaled by
  ``query_pre_attn_scalar ** -0.5``, tanh soft caps on the scores and the logits
  (``attn_logit_softcapping``, ``final_logit_softcapping``), the sliding layers' own rotary
  base (``rope_local_base_freq``) and linear rotary scaling (``LinearRope``) on the others.

As in ``models.gpt``, the model is ``embed -> blocks[i] -> head`` so a pipeline can cut it
by layer, and attention keeps separate Q, K, V and output projections (column- then
row-parallel under tensor parallelism). Parameter names follow Hugging Face's inside a
block (``self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm`` ...), so
``hf_state_dict`` / ``from_hf_state_dict`` only rename the prefixes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.base.config import ATTENTION_MASKS
from shardwise.models import sequence
from shardwise.models.gpt import causal_attention
from shardwise.models.description import section_values
from shardwise.models.hf import LLAMA_PREFIXES, llama_hf_name
from shardwise.models.moe import GATINGS, Experts, MoE, check_groups
from shardwise.models.sampling import DecoderLM, generate  # noqa: F401 (re-exported)


# transformers' names of a layer's attention (``layer_types``): with the window, or without
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rotary frequency scaling (Llama 3 paper, sec. 3.3; HF ``rope_type="llama3"``).

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` tokens
    are stretched by ``factor``, shorter than ``.../ high_freq_factor`` kept, and those in
    between interpolated smoothly. Llama 3.1: factor 8, low 1, high 4, original 8192.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LinearRope:
    """Linear rotary scaling (position interpolation, Chen et al. 2023, arXiv:2306.15595;
    HF ``rope_type = "linear"``, ``_compute_linear_scaling_rope_parameters``): every rotary
    frequency divided by ``factor`` (Gemma 3's global layers: 8)."""

    factor: float


@dataclass(frozen=True)
class LongRope:
    """Phi-3's LongRoPE (Ding et al. 2024, "LongRoPE", arXiv:2402.13753; HF ``rope_type
    = "longrope"``, ``_compute_longrope_parameters``: Phi-3-mini-128k, Phi-3.5-mini,
    Phi-4-mini) in its short regime: rotary frequency i divided by ``short_factor[i]`` (R / 2
    of them), cos and sin multiplied by ``attention_factor``. transformers switches every
    frequency to ``long_factor`` once a sequence is longer than
    ``original_max_position_embeddings`` tokens; ``LlamaConfig`` keeps ``block_size`` at most
    that, so a forward here uses the short factors only, exactly; ``long_factor`` is kept
    for the export.
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float = 1.0


@dataclass(frozen=True)
class Yarn:
    """YaRN's rotary scaling (Peng et al. 2023, "YaRN", arXiv:2309.00071; HF ``rope_type =
    "yarn"``, ``_compute_yarn_parameters``), as DeepSeek-V2/V3 use it with MLA (their
    config.json: factor 40, original 4096, beta_fast 32, beta_slow 1, mscale and
    mscale_all_dim 1 (V2-Lite: 0.707)): frequency i is theta^(-2i/R) / ``factor`` below the
    correction range, unscaled above it, linearly blended in between (the range from
    ``beta_fast`` and ``beta_slow`` rotations over ``original_max_position_embeddings``
    tokens, its ends rounded outwards); cos and sin multiplied by ``attention_factor``
    (None: mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else
    mscale(factor), mscale(s, m) = 0.1 m ln s + 1); and MLA's softmax scale multiplied by
    mscale(factor, mscale_all_dim)^2 when ``mscale_all_dim`` is set
    (``DeepseekV3Attention``'s ``yarn_apply_mscale``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None

    def cos_sin_factor(self) -> float:
        """The factor cos and sin are multiplied by."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor,
                                                                       self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_factor(self) -> float:
        """The factor MLA's softmax scale is multiplied by."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's ``0.1 m ln(scale) + 1`` (1 for a scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of one Llama. Every field has Hugging Face's ``LlamaConfig`` meaning.

    vocab_size: tokens V. block_size: longest sequence T (``max_position_embeddings``).
    n_layer, n_head: blocks and query heads. n_kv_heads: key/value heads (GQA; None means
    ``n_head``, i.e. multi-head attention); must divide ``n_head``. n_embd: width h, a
    multiple of ``n_head``. ffn_hidden: SwiGLU width (``intermediate_size``); None means
    Llama's rule ``multiple_of * ceil(int(8h/3) / multiple_of)``. norm_eps: RMSNorm
    epsilon. rope_theta: rotary base. rope_scaling: ``RopeScaling``, ``LongRope``, a dict
    of either's fields (LongRoPE's with ``rope_type = "longrope"``; with MLA, ``Yarn``'s with
    ``rope_type = "yarn"``), or None. tie_weights:
    head shares the embedding matrix. attention: "sdpa" or "math"
    (``models.gpt.causal_attention``). n_experts: 0 for the dense SwiGLU MLP, else a
    mixture of that many SwiGLU experts in every block (``models.moe.MoE``): ``top_k`` per
    token, of width ``moe_ffn_hidden`` (None: ``ffn_hidden``), ``moe_gating`` "softmax" or
    "sigmoid", the k gates renormalised with ``moe_norm_topk``, auxiliary loss weight
    ``moe_aux_loss_coef``, ``moe_capacity_factor`` (0: dropless), and with
    ``moe_shared_expert`` one more SwiGLU every token goes through, of width
    ``moe_shared_ffn_hidden`` (None: ``moe_ffn_hidden``), its output scaled per token by
    ``sigmoid(x w)`` with ``moe_shared_expert_gate`` (``w`` a replicated (n_embd,) weight,
    ``mlp.shared_expert_gate``: Qwen2-MoE);
    rotary_dim: the first R of each head's D features are rotated, the other D - R pass
    through (Phi-3's ``partial_rotary_factor`` = R / D); even, at most D; None: D.
    dense_layers: with ``n_experts``, the blocks (indices from 0) whose MLP is the dense
    SwiGLU of width ``ffn_hidden`` instead of the mixture (DeepSeek-V2/V3's first
    ``first_k_dense_replace`` blocks, Qwen-MoE's ``mlp_only_layers`` and the blocks
    ``decoder_sparse_step`` skips); () (the default): the mixture in every block. At least
    one block keeps the mixture. moe_n_group > 1: group-limited routing, each token's k
    experts chosen in its ``moe_topk_group`` best of ``moe_n_group`` groups of experts,
    a group scored by ``moe_group_score`` ("top2": the sum of its two best biased scores,
    DeepSeek-V3; "top1": its best, DeepSeek-V2); moe_routed_scaling: the gates' factor
    after renormalisation (DeepSeek's ``routed_scaling_factor``); ``models.moe.route``.
    moe_expert_bias: the routing bias exists even with ``moe_bias_update_rate`` 0 (frozen
    at its loaded value: a DeepSeek-V3 checkpoint's ``e_score_correction_bias``).
    kv_lora_rank > 0: multi-head latent attention (``models.mla``, DeepSeek-V2/V3) instead
    of grouped-query attention: keys and values from a latent of that width, queries from
    one of ``q_lora_rank`` (None: a plain ``q_proj``), each head's query and key
    ``qk_nope_head_dim`` position-free features (even) and ``qk_rope_head_dim`` rotated
    ones (even, the rotated key shared by the heads), its value ``v_head_dim`` wide,
    ``rope_interleave`` the rotated features' pair layout; ``head_dim`` is then qk_nope +
    qk_rope, and GQA's options (``n_kv_heads``, ``qkv_bias``, ``qk_norm``, ``rotary_dim``,
    windows) and a ``rope_scaling`` other than ``Yarn`` (DeepSeek's; with MLA only) are
    refused.
    ``moe_bias_update_rate`` > 0: auxiliary-loss-free balancing (a per-expert routing bias
    moved by that much after each step, DeepSeek-V3; 0: off). sliding_window: W tokens,
    each query i attending to keys i - W < j <= i (``models.gpt.sliding_window_mask``), or
    None (full causal attention); layer_types: per block "sliding_attention" (the window)
    or "full_attention" (none), transformers' ``layer_types``; None: every block
    "sliding_attention" (Mistral's, Mixtral's), so with no window none has one.

    Gemma's options (all off: the Llama): norm_zero_centered: every RMSNorm (QK-norm
    included) stores its weight w zero-centred and scales by 1 + w, in fp32 before the cast
    (transformers' ``GemmaRMSNorm``; w starts at 0; like every 1-D weight it takes no weight
    decay, so the scale is not pulled to 0). scale_embedding: the embedding's output times
    sqrt(n_embd) rounded to its dtype (Gemma's ``normalizer``). mlp_activation: the gated
    MLP's, "silu" (SwiGLU) or "gelu_tanh" (GeGLU, transformers' ``gelu_pytorch_tanh``).
    sandwich_norm: each block ``x + post_attention_layernorm(attn(input_layernorm(x)))``
    then ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`` (Gemma 2/3:
    ``post_attention_layernorm`` is then the attention output's norm, not the MLP's input's
    as in a Llama). query_pre_attn_scalar: the scores scaled by its ``** -0.5`` (None:
    head_dim's). attn_logit_softcapping / final_logit_softcapping: c * tanh(x / c) on the
    scores before the mask (the scores then written out: ``models.gpt.causal_attention``)
    and on the logits (None: no cap). rope_local_base_freq: the rotary base of the blocks
    with a window, which then take no ``rope_scaling`` (Gemma 3's local layers: 10000);
    None: ``rope_theta`` and ``rope_scaling`` on every block. ``rope_scaling`` may also be
    ``LinearRope`` (dict: ``rope_type = "linear"``, ``factor``). attention_mask: "causal",
    or "block_causal": a token attends only to earlier tokens of its own document, when the
    engine (or a caller's ``models.sequence.use``) sets the micro-batch's document ids
    (``models.gpt.causal_attention``: GQA, MLA, windows and soft caps alike). Raises
    ``ValueError`` (one line, naming the fields) for inconsistent sizes or an unknown mask.
    """

    vocab_size: int
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_kv_heads: int | None = None
    n_embd: int = 128
    ffn_hidden: int | None = None
    multiple_of: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | LongRope | LinearRope | None = None
    tie_weights: bool = False
    dropout: float = 0.0
    attention: str = "sdpa"
    n_experts: int = 0
    top_k: int = 2
    moe_ffn_hidden: int | None = None
    moe_gating: str = "softmax"
    moe_norm_topk: bool = True
    moe_aux_loss_coef: float = 0.01
    moe_capacity_factor: float = 0.0
    moe_shared_expert: bool = False
    moe_shared_ffn_hidden: int | None = None
    moe_shared_expert_gate: bool = False
    moe_bias_update_rate: float = 0.0
    dense_layers: tuple[int, ...] = ()
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_group_score: str = "top2"
    moe_routed_scaling: float = 1.0
    moe_expert_bias: bool = False
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    head_dim: int | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    rotary_dim: int | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    norm_zero_centered: bool = False
    scale_embedding: bool = False
    mlp_activation: str = "silu"
    sandwich_norm: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_base_freq: float | None = None
    attention_mask: str = "causal"

    def __post_init__(self):
        if self.attention_mask not in ATTENTION_MASKS:
            raise ValueError(f"model.attention_mask={self.attention_mask!r}: expected "
                             f"{' or '.join(ATTENTION_MASKS)}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "multiple_of"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model.{name}={v!r}: expected a whole number >= 1")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_head)
        self._check_mla()
        if self.n_kv_heads < 1 or self.n_head % self.n_kv_heads:
            raise ValueError(f"model.n_head={self.n_head} is not divisible by "
                             f"model.n_kv_heads={self.n_kv_heads}")
        if self.head_dim is None:
            if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
                raise ValueError(f"model.n_embd={self.n_embd} is not divisible by "
                                 f"2 * model.n_head={2 * self.n_head} (rotary pairs per head)")
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        d = self.head_dim
        if isinstance(d, bool) or not isinstance(d, int) or d < 2 or d % 2:
            raise ValueError(f"model.head_dim={d!r}: expected an even whole number >= 2 "
                             "(rotary pairs per head)")
        r = self.rotary_dim  # None: all D (not filled in, so replace(cfg, head_dim=) keeps it)
        if r is not None and (isinstance(r, bool) or not isinstance(r, int)
                              or not 2 <= r <= d or r % 2):
            raise ValueError(f"model.rotary_dim={r!r}: expected an even whole number from 2 "
                             f"to head_dim={d} (rotary pairs of each head's first features)")
        if self.ffn_hidden is None:
            hidden = int(8 * self.n_embd / 3)
            object.__setattr__(self, "ffn_hidden",
                               self.multiple_of * -(-hidden // self.multiple_of))
        if self.ffn_hidden < 1:
            raise ValueError(f"model.ffn_hidden={self.ffn_hidden}: expected a whole number >= 1")
        if isinstance(self.rope_scaling, dict):
            rope_type = self.rope_scaling.get("rope_type")
            long = rope_type == "longrope"
            kind = {"longrope": LongRope, "linear": LinearRope,
                    "yarn": Yarn}.get(rope_type, RopeScaling)
            known = {f.name for f in fields(kind)}
            extra = set(self.rope_scaling) - known - {"rope_type"}
            if extra:
                raise ValueError(f"model.rope_scaling.{sorted(extra)[0]}: unknown key; "
                                 f"expected {', '.join(sorted(known))}")
            given = {k: v for k, v in self.rope_scaling.items() if k in known}
            if long:
                given = {**given, **{k: tuple(given.get(k) or ())
                                     for k in ("short_factor", "long_factor")}}
            object.__setattr__(self, "rope_scaling", kind(**given))
        rs = self.rope_scaling
        if isinstance(rs, LongRope):
            self._check_long_rope(rs)
        elif isinstance(rs, LinearRope):
            if not rs.factor > 0:
                raise ValueError(f"model.rope_scaling.factor={rs.factor}: expected > 0")
        elif isinstance(rs, Yarn):
            if not self.kv_lora_rank:
                raise ValueError("model.rope_scaling: YaRN (rope_type = \"yarn\") is "
                                 "shardwise's with multi-head latent attention only "
                                 "(model.kv_lora_rank, DeepSeek's)")
            if not (rs.factor > 0 and rs.original_max_position_embeddings >= 1):
                raise ValueError("model.rope_scaling: YaRN expects factor > 0 and "
                                 "original_max_position_embeddings >= 1")
        elif rs is not None and not (rs.factor > 0
                                     and 0 < rs.low_freq_factor < rs.high_freq_factor):
            raise ValueError("model.rope_scaling: expected factor > 0 and "
                             "0 < low_freq_factor < high_freq_factor")
        if self.attention not in ("sdpa", "math"):
            raise ValueError(f"model.attention={self.attention!r}: expected 'sdpa' or 'math'")
        self._check_window()
        self._check_moe()
        self._check_gemma()
        self._check_dense_layers()

    def _check_gemma(self) -> None:
        if self.mlp_activation not in ACTIVATIONS:
            raise ValueError(f"model.mlp_activation={self.mlp_activation!r}: expected "
                             f"{' or '.join(ACTIVATIONS)}")
        if self.mlp_activation != "silu" and self.n_experts:
            raise ValueError(f"model.mlp_activation={self.mlp_activation!r} with "
                             f"model.n_experts={self.n_experts}: the experts are SwiGLU "
                             "(models.moe); use silu")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping", "rope_local_base_freq"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not v > 0):
                raise ValueError(f"model.{name}={v!r}: expected a number > 0, or none")

    def rope_local(self, layer: int) -> bool:
        """Whether block ``layer`` takes the local rotary (``rope_local_base_freq``, no
        scaling): it has a window and the model a local base."""
        return self.rope_local_base_freq is not None and self.windows[layer] is not None

    def _check_mla(self) -> None:
        """MLA's sizes (``kv_lora_rank`` > 0), before ``head_dim`` is derived from them."""
        mla = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
               "rope_interleave")
        if not self.kv_lora_rank:
            given = [k for k in mla if getattr(self, k)]
            if given:
                raise ValueError(f"model.{given[0]} without model.kv_lora_rank: multi-head "
                                 "latent attention's sizes need its latent")
            return
        for k in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model.{k}={v!r}: expected a whole number >= 1 with "
                                 "model.kv_lora_rank")
        q, nope, rot = self.q_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
            raise ValueError(f"model.q_lora_rank={q!r}: expected a whole number >= 1 or none")
        if nope < 0 or nope % 2 or rot % 2:
            raise ValueError(f"model.qk_nope_head_dim={nope} / model.qk_rope_head_dim={rot}: "
                             "expected even numbers (rotary pairs; the head width even)")
        n_kv = self.n_kv_heads if self.n_kv_heads is not None else self.n_head
        other = [k for k, bad in (("n_kv_heads", n_kv != self.n_head),
                                  ("qkv_bias", self.qkv_bias), ("qk_norm", self.qk_norm),
                                  ("rotary_dim", self.rotary_dim is not None),
                                  ("sliding_window", self.sliding_window is not None),
                                  ("rope_scaling", self.rope_scaling is not None
                                   and not _is_yarn(self.rope_scaling)),
                                  ("head_dim", self.head_dim not in (None, nope + rot)),
                                  # Gemma's attention options: not in MLA's kernels
                                  ("query_pre_attn_scalar",
                                   self.query_pre_attn_scalar is not None),
                                  ("attn_logit_softcapping",
                                   self.attn_logit_softcapping is not None),
                                  ("norm_zero_centered", self.norm_zero_centered))
                 if bad]
        if other:
            raise ValueError(f"model.{other[0]} with model.kv_lora_rank (multi-head latent "
                             "attention): not MLA's (its rope scaling: YaRN's only)")
        object.__setattr__(self, "head_dim", nope + rot)

    @property
    def rope_dim(self) -> int:
        """The rotated features R of a head: ``qk_rope_head_dim`` with MLA, else
        ``rotary_dim`` or ``head_dim``."""
        return self.qk_rope_head_dim if self.kv_lora_rank else (self.rotary_dim or self.head_dim)

    def _check_window(self) -> None:
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"model.sliding_window={w!r}: expected a whole number >= 1 "
                             "(tokens each query sees, its own included), or none")
        if self.layer_types is None:
            return
        types = tuple(self.layer_types)
        object.__setattr__(self, "layer_types", types)
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad or len(types) != self.n_layer:
            raise ValueError(f"model.layer_types: expected {self.n_layer} (model.n_layer) of "
                             f"{' or '.join(LAYER_TYPES)}; got "
                             + (repr(bad[0]) if bad else f"{len(types)}"))
        if w is None and "sliding_attention" in types:
            raise ValueError("model.layer_types has sliding_attention layers but "
                             "model.sliding_window is not set")

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per block, its attention window in tokens, or None for full causal attention."""
        types = self.layer_types or ("sliding_attention",) * self.n_layer
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in types)

    def _check_long_rope(self, rs: LongRope) -> None:
        half = (self.rotary_dim or self.head_dim) // 2
        for name in ("short_factor", "long_factor"):
            f = getattr(rs, name)
            if len(f) != half or not all(x > 0 for x in f):
                raise ValueError(f"model.rope_scaling.{name}: expected {half} factors > 0 "
                                 f"(one per rotary frequency), got {len(f)}")
        if not rs.attention_factor > 0:
            raise ValueError(f"model.rope_scaling.attention_factor={rs.attention_factor}: "
                             "expected > 0")
        if self.block_size > rs.original_max_position_embeddings:
            raise ValueError(f"model.block_size={self.block_size} is more than "
                             "model.rope_scaling.original_max_position_embeddings="
                             f"{rs.original_max_position_embeddings}: LongRoPE's long_factor "
                             "takes over beyond it, and shardwise has the short factors only")

    def _check_moe(self) -> None:
        if self.n_experts < 0:
            raise ValueError(f"model.n_experts={self.n_experts}: expected 0 (dense) or more")
        if self.moe_ffn_hidden is None:
            object.__setattr__(self, "moe_ffn_hidden", self.ffn_hidden)
        if self.moe_shared_ffn_hidden is None:
            object.__setattr__(self, "moe_shared_ffn_hidden", self.moe_ffn_hidden)
        if not self.n_experts:
            return
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"model.top_k={self.top_k}: expected 1 <= top_k <= "
                             f"model.n_experts={self.n_experts}")
        if self.moe_gating not in GATINGS:
            raise ValueError(f"model.moe_gating={self.moe_gating!r}: expected "
                             f"{' or '.join(GATINGS)}")
        if self.moe_ffn_hidden < 1 or self.moe_capacity_factor < 0 or self.moe_aux_loss_coef < 0:
            raise ValueError("model.moe_ffn_hidden >= 1, model.moe_capacity_factor >= 0 and "
                             "model.moe_aux_loss_coef >= 0 expected")
        if self.moe_bias_update_rate < 0:
            raise ValueError(f"model.moe_bias_update_rate={self.moe_bias_update_rate}: expected >= 0")
        check_groups(self.n_experts, self.top_k, self.moe_n_group, self.moe_topk_group,
                     self.moe_group_score, self.moe_routed_scaling)
        if self.moe_shared_ffn_hidden < 1:
            raise ValueError(f"model.moe_shared_ffn_hidden={self.moe_shared_ffn_hidden}: "
                             "expected a whole number >= 1 (0 in a run's [model]: "
                             "model.moe_ffn_hidden's)")
        if self.moe_shared_expert_gate and not self.moe_shared_expert:
            raise ValueError("model.moe_shared_expert_gate=True without "
                             "model.moe_shared_expert: there is no shared expert to gate")

    def _check_dense_layers(self) -> None:
        given = tuple(self.dense_layers or ())
        bad = [i for i in given if isinstance(i, bool) or not isinstance(i, int)
               or not 0 <= i < self.n_layer]
        if bad:
            raise ValueError(f"model.dense_layers: {bad[0]!r} is not a block index from 0 to "
                             f"model.n_layer - 1 = {self.n_layer - 1}")
        dense = tuple(sorted(set(given)))
        object.__setattr__(self, "dense_layers", dense)
        if not dense:
            return
        if not self.n_experts:
            raise ValueError(f"model.dense_layers={list(dense)} with model.n_experts=0: "
                             "every block is dense already")
        if len(dense) == self.n_layer:
            raise ValueError("model.dense_layers names every block: set model.n_experts = 0 "
                             "for a dense model")

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` holds the mixture of experts (else the dense SwiGLU)."""
        return self.n_experts > 0 and layer not in self.dense_layers


def _is_yarn(rs) -> bool:
    return isinstance(rs, Yarn) or (isinstance(rs, dict) and rs.get("rope_type") == "yarn")


def _yarn_frequencies(rs: Yarn, d: int, theta: float, device=None) -> torch.Tensor:
    """YaRN's inverse frequencies (R / 2,), as HF ``_compute_yarn_parameters`` (truncated
    correction range)."""
    def correction_dim(rotations: float) -> float:
        return (d * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), d - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    pos = theta ** (torch.arange(0, d, 2, device=device).float() / d)
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=device) - low) / (high - low))
    keep = 1 - ramp.clamp(0, 1)  # 1: extrapolate (unscaled), 0: interpolate (/ factor)
    return (1.0 / (rs.factor * pos)) * (1 - keep) + (1.0 / pos) * keep


def rope_frequencies(cfg: LlamaConfig, device=None, local: bool = False) -> torch.Tensor:
    """Inverse frequencies (R / 2,) fp32, radians per token: ``theta^(-2i/R)``, R the
    rotated features ``rotary_dim`` (head_dim unless partial: as HF
    ``_compute_default_rope_parameters``, whose dim is ``head_dim * partial_rotary_factor``),
    then Llama 3's scaling when ``cfg.rope_scaling`` is ``RopeScaling`` (as HF
    ``_compute_llama3_parameters``), each divided by LongRoPE's short factor when it is
    ``LongRope`` (as HF ``_compute_longrope_parameters`` up to its original length), or by
    the factor of ``LinearRope`` (HF ``_compute_linear_scaling_rope_parameters``), or
    YaRN's (``Yarn``, HF ``_compute_yarn_parameters``: DeepSeek-V2/V3's, with MLA).
    ``local``: a block with the local rotary (``LlamaConfig.rope_local``): theta is
    ``rope_local_base_freq`` and there is no scaling (Gemma 3's sliding layers)."""
    d = cfg.rope_dim
    theta, rs = ((cfg.rope_local_base_freq, None) if local else (cfg.rope_theta, cfg.rope_scaling))
    if isinstance(rs, Yarn):
        return _yarn_frequencies(rs, d, theta, device)
    base = theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d)
    if isinstance(rs, LongRope):  # 1 / (s_i theta^(2i/R)), HF's order of operations
        return 1.0 / (torch.tensor(rs.short_factor, dtype=torch.float32, device=device) * base)
    inv = 1.0 / base
    if rs is None:
        return inv
    if isinstance(rs, LinearRope):
        return inv / rs.factor
    old = rs.original_max_position_embeddings
    low_wavelen, high_wavelen = old / rs.low_freq_factor, old / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(cfg: LlamaConfig, T: int, device=None, dtype=torch.float32,
                 positions: torch.Tensor | None = None, local: bool = False):
    """cos and sin of the rotation angles, each (T, R), R = ``rotary_dim`` (head_dim unless
    partial): angle(t, i) = t * inv_freq[i mod R/2] (the "rotate_half" layout repeats the
    frequencies over both halves); LongRoPE's ``attention_factor`` multiplies both (in
    fp32, before the cast, as HF's rotary embedding).
    ``positions``: (T,) the tokens' positions t (default 0..T-1; a context-parallel rank's
    are its chunks', ``models.sequence.positions``). ``local``: as ``rope_frequencies``."""
    inv = rope_frequencies(cfg, device, local)
    t = torch.arange(T, device=device) if positions is None else positions
    angles = torch.outer(t.to(device=device, dtype=torch.float32), inv)  # (T, d/2)
    emb = torch.cat([angles, angles], dim=-1)  # (T, R)
    cos, sin = emb.cos(), emb.sin()
    if isinstance(cfg.rope_scaling, LongRope) and not local:
        cos, sin = cos * cfg.rope_scaling.attention_factor, sin * cfg.rope_scaling.attention_factor
    elif isinstance(cfg.rope_scaling, Yarn):
        f = cfg.rope_scaling.cos_sin_factor()
        cos, sin = cos * f, sin * f
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) queries or keys: ``x cos + rotate_half(x) sin`` with
    ``rotate_half([x1, x2]) = [-x2, x1]`` (RoFormer, eq. 34, in HF's layout). ``cos`` and
    ``sin`` (T, R) with R < D rotate the first R features only, the halves being those of
    the R, and pass the last D - R through (Phi-3's partial rotary, as HF
    ``models/phi3/modeling_phi3.py``'s ``apply_rotary_pos_emb``)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in fp32 (Zhang &
    Sennrich 2019, arXiv:1910.07467), cast to the input's dtype, then times w (Llama's
    order). ``zero_centered``: w is stored zero-centred, ``(1 + w) * x / sqrt(...)`` all in
    fp32, then cast (transformers' ``GemmaRMSNorm``: Gemma, Gemma 2, Gemma 3; Megatron-Core's
    ``layernorm_zero_centered_gamma``); w starts at 0 (``reset_parameters``), else at 1.
    (..., C) -> (..., C), the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5, zero_centered: bool = False):
        super().__init__()
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.reset_parameters()

    def reset_parameters(self) -> None:
        (nn.init.zeros_ if self.zero_centered else nn.init.ones_)(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def rms_norm(cfg: LlamaConfig, dim: int | None = None) -> RMSNorm:
    """An RMSNorm of the model's kind over ``dim`` features (default ``n_embd``)."""
    return RMSNorm(cfg.n_embd if dim is None else dim, cfg.norm_eps, cfg.norm_zero_centered)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary embeddings. (B, T, C) -> (B, T, C).

    Q has ``n_head`` heads, K and V ``n_kv_heads``, each ``head_dim`` = D wide; each K/V
    head serves ``n_head / n_kv_heads`` consecutive query heads (HF ``repeat_kv``). With
    ``qkv_bias`` the Q, K, V projections have biases (Qwen2); with ``qk_norm``, ``q_norm``
    and ``k_norm`` (RMSNorms of D weights) normalise each head of Q and K, (B, T, H, D)
    over D, before the rotary embedding, as ``Qwen3Attention.forward``. ``layer``: the
    block's index, whose window (``cfg.windows[layer]``: W tokens or None) it attends in,
    with its rotary (``cfg.rope_local(layer)``: Gemma 3's local base on sliding layers).
    The scores are scaled by ``query_pre_attn_scalar ** -0.5`` when set, and soft-capped
    with ``attn_logit_softcapping`` (``models.gpt.causal_attention``)."""

    def __init__(self, cfg: LlamaConfig, layer: int = 0):
        super().__init__()
        self.cfg = cfg
        self.window = cfg.windows[layer]
        self.local_rope = cfg.rope_local(layer)
        q_scalar = cfg.query_pre_attn_scalar
        self.scale = None if q_scalar is None else q_scalar ** -0.5
        self.n_head, self.n_kv_heads, self.head_dim = cfg.n_head, cfg.n_kv_heads, cfg.head_dim
        bias = cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        if cfg.qk_norm:
            self.q_norm = rms_norm(cfg, cfg.head_dim)
            self.k_norm = rms_norm(cfg, cfg.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, C) -> (B, T, H, D); a tensor-parallel rank holds -1 = its share of heads
        q, k, v = (p(x).view(B, T, -1, self.head_dim)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.cfg.qk_norm:  # per head, before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        cos, sin = rope_cos_sin(self.cfg, T, x.device, x.dtype,  # (T, D) each
                                positions=sequence.positions(T, x.device),
                                local=self.local_rope)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        p = self.cfg.dropout if self.training else 0.0
        y = causal_attention(q, k, v, p, self.cfg.attention,  # (B, H, T, D); k, v: Hkv heads
                             window=self.window, scale=self.scale,
                             softcap=self.cfg.attn_logit_softcapping)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


# the gated MLP's activation (``mlp_activation``): SiLU (SwiGLU, Llama) or the tanh GELU
# (GeGLU, Gemma: transformers' ``gelu_pytorch_tanh``, F.gelu's "tanh")
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """Gated MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``, act SiLU (SwiGLU) or the
    tanh GELU (GeGLU) as ``cfg.mlp_activation``, width ``hidden`` (default
    ``ffn_hidden``). (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: LlamaConfig, hidden: int | None = None):
        super().__init__()
        hidden = cfg.ffn_hidden if hidden is None else hidden
        self.gate_proj = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, cfg.n_embd, bias=False)
        self.act = ACTIVATIONS[cfg.mlp_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def moe(cfg: LlamaConfig) -> MoE:
    """The mixture of experts that replaces the MLP when ``cfg.n_experts`` > 0."""
    shared = MLP(cfg, cfg.moe_shared_ffn_hidden) if cfg.moe_shared_expert else None
    return MoE(cfg.n_embd, cfg.n_experts, cfg.moe_ffn_hidden, cfg.top_k, cfg.moe_gating,
               cfg.moe_norm_topk, cfg.moe_aux_loss_coef, cfg.moe_capacity_factor,
               shared_expert=shared, shared_expert_gate=cfg.moe_shared_expert_gate,
               bias_update_rate=cfg.moe_bias_update_rate, n_group=cfg.moe_n_group,
               topk_group=cfg.moe_topk_group, group_score=cfg.moe_group_score,
               routed_scaling=cfg.moe_routed_scaling, expert_bias=cfg.moe_expert_bias)


class Block(nn.Module):
    """Pre-RMSNorm block: ``x + self_attn(input_layernorm(x))`` then
    ``x + mlp(post_attention_layernorm(x))``, ``mlp`` a gated ``MLP`` or, with
    ``n_experts`` and ``layer`` not in ``dense_layers``, a ``models.moe.MoE``; ``layer`` its
    index (its attention window, its MLP); the attention DeepSeek's multi-head latent one
    (``models.mla``) with ``kv_lora_rank``.
    With ``sandwich_norm`` (Gemma 2, arXiv:2408.00118 sec. 2; Gemma 3), four norms under
    transformers' ``Gemma2DecoderLayer`` names: ``x + post_attention_layernorm(self_attn(
    input_layernorm(x)))`` then ``x + post_feedforward_layernorm(mlp(
    pre_feedforward_layernorm(x)))``. (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: LlamaConfig, layer: int = 0):
        super().__init__()
        self.sandwich = cfg.sandwich_norm
        self.input_layernorm = rms_norm(cfg)
        if cfg.kv_lora_rank:  # DeepSeek's multi-head latent attention
            from shardwise.models.mla import LatentAttention

            self.self_attn = LatentAttention(cfg, RMSNorm, rope_cos_sin, apply_rope)
        else:
            self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = rms_norm(cfg)
        if self.sandwich:
            self.pre_feedforward_layernorm = rms_norm(cfg)
        self.mlp = moe(cfg) if cfg.is_moe(layer) else MLP(cfg)
        if self.sandwich:
            self.post_feedforward_layernorm = rms_norm(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x)))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Module):
    """Token embedding only (positions enter through the rotary angles). (B, T) -> (B, T, C).
    With ``scale_embedding`` the rows are multiplied by sqrt(C) rounded to their dtype first
    (Gemma's ``normalizer``, arXiv:2403.08295; transformers'
    ``GemmaTextScaledWordEmbedding``: bf16 rounds sqrt(3072) = 55.43 to 55.5)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.scale = math.sqrt(cfg.n_embd) if cfg.scale_embedding else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        if self.scale is None:
            return x
        return x * torch.tensor(self.scale, dtype=x.dtype, device=x.device)


class LMHead(nn.Module):
    """Final RMSNorm and projection to the vocabulary. (B, T, C) -> (B, T, V) logits. With
    ``final_logit_softcapping`` c the logits are ``c * tanh(logits / c)`` (Gemma 2,
    arXiv:2408.00118 sec. 2; transformers' ``Gemma2ForCausalLM.forward``): element-wise, so
    a tensor-parallel rank caps its slice of the vocabulary, and the loss and sampling read
    the capped logits."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.norm = rms_norm(cfg)
        self.proj = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.softcap = cfg.final_logit_softcapping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.proj(self.norm(x))
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap


class Llama(DecoderLM):
    """``embed -> blocks -> head``. ``forward(idx (B, T) int64, targets (B, T) | None)``.

    Returns ``(logits (B, T, V), loss)``, ``loss`` the mean cross-entropy in nats per token
    over targets other than -100 (None without targets). Raises ``ValueError`` if ``T >
    block_size``. Init as HF's Llama: normal(0, 0.02) for linear and embedding weights,
    zeros for the biases (``qkv_bias``), ones for the norms (zeros when
    ``norm_zero_centered``: a scale of 1 either way), drawn from the global torch generator
    in module order, so ``torch.manual_seed(s); Llama(cfg)`` is reproducible (experts:
    normal(0, 0.02) too).
    With ``n_experts`` the blocks' auxiliary losses enter the gradient of any loss
    backpropagated through them (``models.moe.AuxLossScaler``); ``loss`` stays the
    cross-entropy.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.head = LMHead(cfg)
        if cfg.tie_weights:
            self.head.proj.weight = self.embed.tok.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            m.reset_parameters()
        elif isinstance(m, Experts):
            m.reset_parameters(std=0.02)


def hf_name(name: str) -> str:
    """Our parameter name -> ``LlamaForCausalLM``'s (``models.hf.llama_hf_name``).
    Raises ``KeyError`` for a name it does not know."""
    return llama_hf_name(name)


def hf_state_dict(model: Llama) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` under Hugging Face ``LlamaForCausalLM`` names (the same
    tensors, not copies). With tied weights both ``model.embed_tokens.weight`` and
    ``lm_head.weight`` are present, as in HF's own state dict."""
    return {hf_name(k): v for k, v in model.state_dict().items()}


def from_hf_state_dict(sd: dict[str, torch.Tensor],
                       tie_weights: bool = False) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` state dict under our names, for ``Llama.load_state_dict``.
    Buffers HF may store (``rotary_emb.inv_freq``) are dropped: ours are computed. With
    ``tie_weights`` a missing ``lm_head.weight`` is the embedding. Raises ``KeyError``
    naming an unknown key."""
    back = {theirs: ours for ours, theirs in LLAMA_PREFIXES}
    out = {}
    for key, value in sd.items():
        if "rotary_emb." in key:
            continue
        for theirs, ours in back.items():
            if key.startswith(theirs):
                out[ours + key[len(theirs):]] = value
                break
        else:
            raise KeyError(f"{key}: not a LlamaForCausalLM parameter name")
    if tie_weights and "head.proj.weight" not in out:
        out["head.proj.weight"] = out["embed.tok.weight"]
    return out


# Llama's tensor-parallel plan (as torchtitan's ``parallelize_llama``; styles in
# ``models.description``): Q, K, V column-parallel by heads (the key/value heads split over
# tp too: each rank keeps the kv heads its query heads read), ``o_proj`` row-parallel;
# SwiGLU's gate and up column-parallel reading one input, ``down_proj`` row-parallel; the
# vocabulary split in the embedding and the head; RMSNorms token-wise under SP. Biases of
# Q, K, V (Qwen2) are split with their rows; Qwen3's q_norm / k_norm (D weights shared by
# every head) are replicated, each rank's gradient the part of its heads, summed over tp
# (HF's "replicated_with_grad_allreduce"): ``models.description``'s "partial_grad".
TP_PLAN = {
    "embed.tok": "vocab_embedding",
    "blocks.*.input_layernorm": "sequence_parallel",
    "blocks.*.self_attn": "attention",
    "blocks.*.self_attn.[qkv]_proj": "column",
    "blocks.*.self_attn.o_proj": "row",
    "blocks.*.post_attention_layernorm": "sequence_parallel",
    "blocks.*.mlp": "shared_input",
    "blocks.*.mlp.gate_proj": "column",
    "blocks.*.mlp.up_proj": "column",
    "blocks.*.mlp.down_proj": "row",
    "head.norm": "sequence_parallel",
    "head.proj": "vocab_head",
}
# With experts the MLP's entries give way to the MoE's (torchtitan's ``apply_moe_ep_tp``):
# the router replicated, the stacked experts split by expert over ep and by width over tp
# (Megatron-Core's expert tensor parallelism), the shared expert as a dense SwiGLU; under
# SP the whole block one region ("moe": its input all-gathered along the sequence, its
# output reduce-scattered, the router reading whole sequences as without SP). A shared
# expert's gate (``mlp.shared_expert_gate``, Qwen2-MoE) is replicated as the router is, and
# for the same reason needs no style: without SP it reads the block's replicated input and
# scales the shared expert's output after its row-parallel all-reduce, so every tp rank
# computes its whole gradient (a sum over tp, "partial_grad", would count it tp times);
# under SP it scales the rank's partial sum, and its partial gradient is summed over tp
# with the router's (the optimizer sums every replicated gradient under SP).
MOE_TP_PLAN = {
    **{k: v for k, v in TP_PLAN.items() if not k.startswith("blocks.*.mlp")},
    "blocks.*.mlp": "moe",
    "blocks.*.mlp.experts": "experts",
    "blocks.*.mlp.shared_expert": "shared_input",
    "blocks.*.mlp.shared_expert.gate_proj": "column",
    "blocks.*.mlp.shared_expert.up_proj": "column",
    "blocks.*.mlp.shared_expert.down_proj": "row",
}


# fp8 leaves the routers in bf16 (torchtitan's float8 ``filter_fqns``): their top-k choices
# would change with float8 rounding
ROUTERS = ("blocks.*.mlp.router",)


# sandwich_norm's two more norms (Gemma 2/3), token-wise as the others; the attention output's
# is post_attention_layernorm, already in the plan
SANDWICH_TP_PLAN = {"blocks.*.pre_feedforward_layernorm": "sequence_parallel",
                    "blocks.*.post_feedforward_layernorm": "sequence_parallel"}


def _gqa_only(plan: dict[str, str], cfg: LlamaConfig) -> dict[str, str]:
    """``plan`` less GQA's Q/K/V entry when the attention is MLA's."""
    if not cfg.kv_lora_rank:
        return plan
    return {k: v for k, v in plan.items() if k != "blocks.*.self_attn.[qkv]_proj"}


def _mla_plan(cfg: LlamaConfig) -> dict[str, str]:
    """MLA's entries (``models.mla``): heads split (the up projections column-parallel,
    ``o_proj`` row-parallel, from ``TP_PLAN``), the down projections and their norms
    replicated with partial gradients."""
    q = ({"blocks.*.self_attn.q_b_proj": "column",
          "blocks.*.self_attn.q_a_proj": "partial_grad",
          "blocks.*.self_attn.q_a_layernorm": "partial_grad"} if cfg.q_lora_rank
         else {"blocks.*.self_attn.q_proj": "column"})
    return {**q, "blocks.*.self_attn.kv_b_proj": "column",
            "blocks.*.self_attn.kv_a_proj_with_mqa": "partial_grad",
            "blocks.*.self_attn.kv_a_layernorm": "partial_grad"}


def tp_plan(cfg: LlamaConfig) -> dict[str, str]:
    """``TP_PLAN``, or with experts ``MOE_TP_PLAN`` (less the shared expert's rows when
    there is none; the blocks of ``dense_layers`` with ``TP_PLAN``'s MLP entries, named
    block by block); with ``qk_norm``, ``q_norm`` / ``k_norm`` as "partial_grad"; with
    ``kv_lora_rank``, MLA's entries instead of Q/K/V's (``_mla_plan``); with
    ``sandwich_norm``, ``SANDWICH_TP_PLAN`` too."""
    qk = {"blocks.*.self_attn.[qk]_norm": "partial_grad"} if cfg.qk_norm else {}
    if cfg.kv_lora_rank:
        qk = _mla_plan(cfg)
    if cfg.sandwich_norm:
        qk.update(SANDWICH_TP_PLAN)
    if not cfg.n_experts:
        return {**_gqa_only(TP_PLAN, cfg), **qk}
    plan = {k: v for k, v in _gqa_only(MOE_TP_PLAN, cfg).items()
            if cfg.moe_shared_expert or "shared_expert" not in k}
    if cfg.dense_layers:  # their dense SwiGLU as the Llama's (the last matching entry wins)
        plan.update({f"blocks.{i}.mlp": "shared_input" for i in cfg.dense_layers})
        plan.update({k: v for k, v in TP_PLAN.items() if k.startswith("blocks.*.mlp.")})
    return {**plan, **qk}


def describe(cfg: LlamaConfig):
    """The Llama as a ``models.description.ModelDescription`` (kind "llama"). tp must divide
    the query heads, the key/value heads (each rank holds whole kv heads: the ones its
    query heads share) and the SwiGLU width (the experts' with ``n_experts``, and a shared
    expert's ``moe_shared_ffn_hidden``, and ``ffn_hidden`` with ``dense_layers``); ep must
    divide ``n_experts``. Hugging Face's ``LlamaForCausalLM`` in and out: ``models.hf.LLAMA``
    (``MistralForCausalLM`` in, ``models.hf.MISTRAL``, is this too, and out again when the
    run came from one: ``models.hf.export_arch``);
    with ``qkv_bias``, ``Qwen2ForCausalLM`` (``QWEN2``); with ``qk_norm``,
    ``Qwen3ForCausalLM`` (``QWEN3``); with ``n_experts`` and neither, ``MixtralForCausalLM``
    (``models.hf.MIXTRAL``) when the mixture is Mixtral's (``models.hf.mixtral_compatible``:
    softmax top-k renormalised, dropless, no shared expert); with ``n_experts`` and
    ``qk_norm``, ``Qwen3MoeForCausalLM`` (``QWEN3_MOE``) when the mixture is Qwen3-MoE's
    (``models.hf.qwen3_moe_compatible``: softmax top-k, renormalised or not, dropless, no
    shared expert); with ``n_experts``, no ``qk_norm`` and a shared expert with
    ``moe_shared_expert_gate`` (any ``moe_shared_ffn_hidden``, ``qkv_bias`` or not),
    ``Qwen2MoeForCausalLM`` (``QWEN2_MOE``) when the mixture is Qwen2-MoE's
    (``models.hf.qwen2_moe_compatible``: softmax top-k, renormalised or not, dropless);
    with Gemma's zero-centred norms, embedding scale and GeGLU, ``GemmaForCausalLM``
    (``GEMMA``), with the sandwich norms too ``Gemma2ForCausalLM`` (``GEMMA2``), and with
    QK-norm ``Gemma3ForCausalLM`` (``GEMMA3``: ``models.hf.gemma._gemma_holds``);
    else none (``hf`` is None): ``models.hf.arch_for``."""
    from shardwise.models.description import ModelDescription
    from shardwise.models.hf import arch_for

    width = ({"model.moe_ffn_hidden (expert width)": cfg.moe_ffn_hidden} if cfg.n_experts
             else {"model.ffn_hidden (SwiGLU width)": cfg.ffn_hidden})
    if cfg.n_experts and cfg.moe_shared_expert:
        width["model.moe_shared_ffn_hidden (shared expert width)"] = cfg.moe_shared_ffn_hidden
    if cfg.dense_layers:
        width["model.ffn_hidden (dense layers' SwiGLU width)"] = cfg.ffn_hidden
    return ModelDescription(
        kind="llama", config=cfg, build=lambda: Llama(cfg), tp_plan=tp_plan(cfg),
        hidden_size=cfg.n_embd, vocab_size=cfg.vocab_size, block_size=cfg.block_size,
        # ring attention carries neither MLA's narrower values nor a soft cap on the scores
        n_layer=cfg.n_layer,
        context_parallel=not cfg.kv_lora_rank and cfg.attn_logit_softcapping is None,
        # MLA: Q K^T over Dqk features, P V over v_head_dim: their mean for 12 (H D) per key
        attention_width=cfg.n_head * ((cfg.head_dim + cfg.v_head_dim) // 2 if cfg.kv_lora_rank
                                      else cfg.head_dim),
        attention_windows=cfg.windows if cfg.sliding_window is not None else (),
        # the math path, or soft-capped scores (a tanh's output more): written out T x T
        written_scores=(int(cfg.attention == "math" or cfg.attn_logit_softcapping is not None)
                        + (cfg.attn_logit_softcapping is not None)),
        attention_mask=cfg.attention_mask,
        tied=("embed.tok.weight", "head.proj.weight") if cfg.tie_weights else None,
        tp_divides={"model.n_head (attention heads)": cfg.n_head,
                    "model.n_kv_heads (key/value heads)": cfg.n_kv_heads, **width},
        n_experts=cfg.n_experts,
        capacity_factor=cfg.moe_capacity_factor if cfg.n_experts else 0.0,  # dense: unused
        keep_high_precision=ROUTERS if cfg.n_experts else (),
        hf=arch_for(cfg))


def from_section(m, vocab_size: int) -> LlamaConfig:
    """The Llama of a run's ``[model]`` section (``base.model_config.LlamaModelConfig``, or
    ``ModelConfig``): each ``LlamaConfig`` field from the section's field of that name, a
    section's 0 meaning None where ``LlamaConfig``'s default is None (Llama's defaults:
    n_head key/value heads, the 8h/3 rule, ffn_hidden, n_embd / n_head; no window, scalar
    or cap); ``model.vocab_size`` when set, else ``vocab_size`` (the tokenizer's). Raises
    ``ValueError`` (one line) for a field only the GPT has (``activation`` other than gelu,
    ``k_bias``) in a section of every decoder field."""
    if getattr(m, "k_bias", False) or getattr(m, "activation", "gelu") != "gelu":
        raise ValueError("model.k_bias / model.activation: the GPT's; the Llama has no "
                         "biases and a SwiGLU MLP")
    return LlamaConfig(vocab_size=m.vocab_size or vocab_size,
                       **section_values(m, LlamaConfig, skip=("vocab_size",)))

