"""The Llama's config (``LlamaConfig``) and its rotary scalings; the fields are the
``[model]`` section's (``base.model_config.LlamaModelConfig``), declared once there."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from shardwise.base.model_config import (
    ATTENTION_MASKS,
    MLP_ACTIVATIONS,
    LlamaModelConfig,
    gqa_only,
    section_dataclass,
    zero_means_unset,
)


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


# the Llama's fields: the [model] section's (LlamaModelConfig, each described there), the
# head untied by default (Hugging Face's); the first ones in the order callers may pass them
# by position (LlamaConfig(V, T, L, ...))
_LlamaFields = section_dataclass(
    "_LlamaFields", LlamaModelConfig,
    ("block_size", "n_layer", "n_head", "n_kv_heads", "n_embd", "ffn_hidden", "multiple_of",
     "norm_eps", "rope_theta", "rope_scaling", "tie_weights", "dropout", "attention"),
    defaults={"tie_weights": False})


# the section's real-valued fields whose 0 means unset (Gemma's scalar and soft caps, its
# local rotary base): None here, else > 0
_UNSET_SCALARS = tuple(n for n, i in LlamaModelConfig.model_fields.items()
                       if zero_means_unset(i) and i.annotation is float)


# the section's options MLA's kernels have not (``GQA_ONLY``): set, they are refused with it
_GQA_ONLY = tuple(n for n, i in LlamaModelConfig.model_fields.items() if gqa_only(i))


class LlamaConfig(_LlamaFields):
    """Sizes of one Llama: the fields of ``base.model_config.LlamaModelConfig`` (the
    ``[model]`` section of ``model.kind = "llama"``, each field described there, with
    Hugging Face's ``LlamaConfig`` meaning), ``vocab_size`` first and required,
    ``tie_weights`` False by default, and None where the section writes 0 for "unset"
    (``n_kv_heads``: n_head; ``ffn_hidden``: Llama's rule ``multiple_of * ceil(int(8h/3) /
    multiple_of)``; ``moe_ffn_hidden``: ffn_hidden; ``moe_shared_ffn_hidden``:
    moe_ffn_hidden; ``head_dim``: n_embd / n_head, or qk_nope + qk_rope with MLA;
    ``q_lora_rank``, ``rotary_dim``, ``sliding_window``, the Gemma scalars and soft caps:
    none). Those are filled in when the config is made; ``rope_scaling`` may be a
    ``RopeScaling``, ``LongRope``, ``LinearRope``, ``Yarn`` (with MLA) or a dict of one's
    fields (``rope_type`` "longrope", "linear" or "yarn"). Raises ``ValueError`` (one line,
    naming the fields) for inconsistent sizes or an unknown option."""

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
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"model.mlp_activation={self.mlp_activation!r}: expected "
                             f"{' or '.join(MLP_ACTIVATIONS)}")
        if self.mlp_activation != "silu" and self.n_experts:
            raise ValueError(f"model.mlp_activation={self.mlp_activation!r} with "
                             f"model.n_experts={self.n_experts}: the experts are SwiGLU "
                             "(models.moe); use silu")
        for name in _UNSET_SCALARS:  # the section's 0-means-unset numbers: > 0 when set
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
                                  *((n, getattr(self, n) not in (None, False)) for n in _GQA_ONLY),
                                  ("rope_scaling", self.rope_scaling is not None
                                   and not _is_yarn(self.rope_scaling)),
                                  ("head_dim", self.head_dim not in (None, nope + rot)))
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
        from shardwise.models.moe import GATINGS, check_groups  # torch: only with experts

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
            raise ValueError(f"model.moe_bias_update_rate={self.moe_bias_update_rate}: "
                             "expected >= 0")
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


