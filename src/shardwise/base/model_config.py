"""The ``[model]`` section: what every kind shares, and one class per model kind.

``ModelSection`` holds the fields every kind has (its kind, the module that registers it,
the decoder's sizes the engine and the data read, ``init_from``); each kind's class adds its
own fields, each declared once with its description and checked by its validators:
``GPTModelConfig`` (``model.kind = "gpt"``), ``LlamaModelConfig`` (``"llama"``, the Llama
family: Mistral, Qwen, Phi-3, Gemma, Mixtral, DeepSeek) and a user's class registered with
``shardwise.register_model`` (a subclass of ``ModelSection``: ``register_section``).
``Config`` picks the class from ``model.kind`` (``section_class``). ``ModelConfig`` is every
decoder field of shardwise's kinds at once: the section of a kind registered with a config
type of its own (not a section), and of an ``init_from`` run before its config.json names
the kind. Imports nothing of shardwise's (base is the bottom layer).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

# model.attention_mask (torchtitan's attn_mask_type names; the models take them from here)
ATTENTION_MASKS = ("causal", "block_causal")
# model.mlp_activation, the Llama's gated MLP (models.llama maps each to its function)
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
# a field whose 0 means "unset" (TOML has no None): the model's config holds None there
ZERO_MEANS_UNSET = {"zero_means_unset": True}


# a Llama option of grouped-query attention that multi-head latent attention (kv_lora_rank)
# has not: set with MLA, it is refused (models.llama_config)
GQA_ONLY = {"gqa_only": True}
UNSET_GQA_ONLY = {**ZERO_MEANS_UNSET, **GQA_ONLY}


def zero_means_unset(info: Any) -> bool:
    """Whether a section field (pydantic ``FieldInfo``) writes "unset" as 0."""
    return bool((info.json_schema_extra or {}).get("zero_means_unset"))


def gqa_only(info: Any) -> bool:
    """Whether a section field is an option of grouped-query attention only (``GQA_ONLY``)."""
    return bool((info.json_schema_extra or {}).get("gqa_only"))


class _Section(BaseModel):
    # allow_inf_nan=False: a TOML literal inf or nan (``--optimizer.lr inf``) is no size,
    # rate or timeout; refused at the door instead of failing inside the ranks
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True,
                              allow_inf_nan=False)


class ModelSection(_Section):
    """Model: the fields every kind shares; ``model.kind`` picks the rest (``shardwise train
    --help --model.kind llama`` lists a kind's). ``vocab_size`` comes from the tokenizer
    when left at 0. ``kind = "cnn"`` trains the convolutional classifier (the [cnn]
    section)."""

    label: ClassVar[str] = "this model"  # in messages: "the GPT has no such option"
    # a field of another kind given to this one: its own message, else "has no such option"
    refusals: ClassVar[dict[str, str]] = {}

    kind: str = Field("gpt", description="gpt, llama, a kind registered with "
                      "shardwise.register_model, or cnn (Fashion-MNIST; sizes in [cnn])")
    module: str = Field("", description="a Python module name or a path to a .py file, "
                        "imported (its code run) before model.kind is looked up, on the "
                        "launcher and on every rank: the module that registers your model "
                        "(docs/models.md); empty: none")

    n_layer: int = Field(4, ge=1, description="transformer blocks")
    n_head: int = Field(4, ge=1, description="attention heads per block")
    n_embd: int = Field(128, ge=1, description="residual stream width (d_model)")
    block_size: int = Field(128, ge=1, description="context length in tokens")
    vocab_size: int = Field(0, ge=0, description="0: take it from the tokenizer")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability on the "
                           "embeddings, attention weights and residual branches; 0: none")
    tie_weights: bool = Field(True, description="share the token embedding with the LM head")
    attention: str = Field("sdpa", description="sdpa: fused scaled_dot_product_attention "
                           "(FlashAttention on CUDA); math: the scores written out")
    attention_mask: str = Field("causal", description="causal: each token attends to every "
                                "earlier token of its sequence; block_causal: only to "
                                "earlier tokens of its own document, documents ending at the "
                                "tokenizer's end-of-text token (Llama 3's packed sequences; "
                                "a prepared tokenizer's eos_id, docs/models.md)")
    norm_eps: float = Field(1e-5, gt=0.0, description="the norms' epsilon (the GPT's "
                            "LayerNorms, the Llama's RMSNorms)")
    init_from: str = Field("", description="hf:DIR: start from a Hugging Face checkpoint "
                           "(LlamaForCausalLM, MistralForCausalLM, GPT2LMHeadModel, "
                           "MixtralForCausalLM, "
                           "Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen2MoeForCausalLM, "
                           "Qwen3MoeForCausalLM, Phi3ForCausalLM, GemmaForCausalLM, "
                           "Gemma2ForCausalLM, Gemma3ForCausalLM, "
                           "Gemma3ForConditionalGeneration (its language model), "
                           "DeepseekV3ForCausalLM or DeepseekV2ForCausalLM: "
                           "config.json and safetensors files); the model's kind and sizes "
                           "come from its config.json, and "
                           "a [model] field set to another value is refused; empty: from "
                           "training.seed")


    @model_validator(mode="after")
    def _shared_rules(self):
        if self.attention not in ("sdpa", "math"):
            raise ValueError(f"model.attention={self.attention!r}: expected sdpa or math")
        if self.attention_mask not in ATTENTION_MASKS:
            raise ValueError(f"model.attention_mask={self.attention_mask!r}: expected "
                             f"{' or '.join(ATTENTION_MASKS)}")
        if not self.kind.replace("-", "_").isidentifier():
            raise ValueError(f"model.kind={self.kind!r}: expected gpt, llama, cnn or a "
                             "registered model's name")
        if self.n_embd % self.n_head and not getattr(self, "head_dim", 0):
            raise ValueError(f"model.n_embd={self.n_embd} must be divisible by "
                             f"model.n_head={self.n_head} (or set model.head_dim)")
        if self.init_from and not (self.init_from.startswith("hf:") and self.init_from[3:]):
            raise ValueError(f"model.init_from={self.init_from!r}: expected hf:DIR (a Hugging "
                             "Face checkpoint directory) or empty")
        return self

    @property
    def experts(self) -> int:
        """Experts in each block's mixture; 0 for a dense model (every kind without one)."""
        return 0

    def context_parallel_refusal(self, cp: int, a2a: int = 1) -> str | None:
        """Why context parallelism (``parallel.cp`` > 1, an all-to-all over ``a2a`` of its
        ranks and ring attention across the rest) cannot run this model, or None."""
        if self.dropout > 0:
            return (f"model.dropout={self.dropout} with parallel.cp={cp}: ring attention has "
                    "no attention dropout; set model.dropout = 0")
        return None


class GPTModelConfig(ModelSection):
    """The GPT's ``[model]`` (``model.kind = "gpt"``, the default; ``models.gpt``)."""

    label: ClassVar[str] = "the GPT"
    refusals: ClassVar[dict[str, str]] = {
        "n_experts": "model.n_experts={value} with model.kind=gpt: the mixture of experts is "
                     "the Llama's; set model.kind = llama",
        "rope_scaling": "model.rope_scaling: the GPT has learned positions, no rotary "
                        "embedding (model.kind = \"llama\" has)"}

    bias: bool = Field(True, description="biases in the linear layers and LayerNorms (a key "
                       "bias only with model.k_bias)")
    activation: str = Field("gelu", description="the MLP's GELU, gelu (exact) or "
                            "gelu_tanh (GPT-2's tanh approximation)")
    k_bias: bool = Field(False, description="a bias on the key projection too (GPT-2 "
                         "has one; softmax ignores it)")

    @model_validator(mode="after")
    def _gpt_rules(self):
        if self.activation not in ("gelu", "gelu_tanh"):
            raise ValueError(f"model.activation={self.activation!r}: expected gelu or gelu_tanh")
        return self


class LlamaModelConfig(ModelSection):
    """The Llama family's ``[model]`` (``model.kind = "llama"``; ``models.llama``): Llama 2
    and 3, Mistral, Qwen2/3, Phi-3, Gemma 1-3, Mixtral, Qwen-MoE, DeepSeek-V2/V3."""

    label: ClassVar[str] = "the Llama"
    refusals: ClassVar[dict[str, str]] = {
        "k_bias": "model.k_bias / model.activation: the GPT's; the Llama has no biases and a "
                  "SwiGLU MLP",
        "activation": "model.k_bias / model.activation: the GPT's; the Llama has no biases "
                      "and a SwiGLU MLP"}

    n_kv_heads: int = Field(0, ge=0, json_schema_extra=ZERO_MEANS_UNSET,
                            description="key/value heads (grouped-query attention); 0: n_head")
    ffn_hidden: int = Field(0, ge=0, json_schema_extra=ZERO_MEANS_UNSET,
                            description="SwiGLU width; 0: Llama's rule, 8 n_embd / 3 rounded up "
                                        "to multiple_of")
    multiple_of: int = Field(256, ge=1, description="the SwiGLU width's rounding")
    rope_theta: float = Field(10000.0, gt=0.0, description="rotary base theta")
    n_experts: int = Field(0, ge=0, description="experts in each block's mixture of "
                           "experts (docs/moe.md); 0: the dense SwiGLU MLP")
    top_k: int = Field(2, ge=1, description="with n_experts: experts each token is "
                       "routed to")
    moe_ffn_hidden: int = Field(0, ge=0, json_schema_extra=ZERO_MEANS_UNSET,
                                description="with n_experts: each expert's SwiGLU width; 0: "
                                            "model.ffn_hidden's")
    moe_gating: str = Field("softmax", description="with n_experts: softmax (top-k of "
                            "the softmax, Switch/GShard/Mixtral) or sigmoid (top-k of the "
                            "sigmoids, DeepSeek-V3)")
    moe_norm_topk: bool = Field(True, description="with n_experts: renormalise the k "
                                "gate weights to sum to 1 (Mixtral, DeepSeek-V3)")
    moe_aux_loss_coef: float = Field(0.01, ge=0.0, description="with n_experts: weight "
                                     "of the load-balancing loss (Switch's alpha), per "
                                     "sequence (DeepSeek-V3's sequence-wise form)")
    moe_capacity_factor: float = Field(0.0, ge=0.0, description="with n_experts: at "
                                       "most ceil(factor x tokens x top_k / n_experts) "
                                       "tokens per expert per micro-batch and rank, the rest "
                                       "dropped (GShard); 0: dropless")
    moe_shared_expert: bool = Field(False, description="with n_experts: one more "
                                    "SwiGLU expert every token goes through (DeepSeek-V3)")
    moe_shared_ffn_hidden: int = Field(0, ge=0, json_schema_extra=ZERO_MEANS_UNSET,
                                       description="with moe_shared_expert: the shared expert's "
                                                   "SwiGLU width (Qwen2-MoE's "
                                                   "shared_expert_intermediate_size); 0: "
                                                   "model.moe_ffn_hidden's")
    moe_shared_expert_gate: bool = Field(False, description="with moe_shared_expert: "
                                         "scale the shared expert's output per token by "
                                         "sigmoid(x w), w a replicated (n_embd,) weight "
                                         "(Qwen2-MoE's shared_expert_gate)")
    moe_bias_update_rate: float = Field(0.0, ge=0.0, description="with n_experts: "
                                        "auxiliary-loss-free balancing (DeepSeek-V3): a "
                                        "per-expert bias on the routing scores, for the top-k "
                                        "choice only, moved by this much after each step "
                                        "towards the mean load (0.001 in the paper); 0: off")
    moe_n_group: int = Field(1, ge=1, description="with n_experts: group-limited "
                             "routing, the experts in this many groups and each token's "
                             "top_k chosen in its moe_topk_group best groups (DeepSeek's "
                             "n_group); 1: off")
    moe_topk_group: int = Field(1, ge=1, description="with moe_n_group > 1: groups "
                                "each token's experts are chosen in (DeepSeek's topk_group)")
    moe_group_score: str = Field("top2", description="with moe_n_group > 1: a group's "
                                 "score, top2 (the sum of its two best biased scores: "
                                 "DeepSeek-V3) or top1 (its best: DeepSeek-V2)")
    moe_routed_scaling: float = Field(1.0, gt=0.0, description="with n_experts: the "
                                      "routed experts' gates multiplied by this after "
                                      "renormalisation (DeepSeek's routed_scaling_factor; "
                                      "V3: 2.5)")
    moe_expert_bias: bool = Field(False, description="with n_experts: the routing "
                                  "bias exists even with moe_bias_update_rate 0, frozen at "
                                  "its loaded value (a DeepSeek-V3 checkpoint's "
                                  "e_score_correction_bias)")
    kv_lora_rank: int = Field(0, ge=0, description="multi-head latent attention "
                              "(DeepSeek-V2/V3, docs/models.md): keys and values from a "
                              "latent this wide; 0: grouped-query attention")
    q_lora_rank: int = Field(0, ge=0, json_schema_extra=ZERO_MEANS_UNSET,
                             description="with kv_lora_rank: the queries' latent width; 0: a "
                                         "plain q_proj")
    qk_nope_head_dim: int = Field(0, ge=0, description="with kv_lora_rank: each head's "
                                  "position-free query/key features (even)")
    qk_rope_head_dim: int = Field(0, ge=0, description="with kv_lora_rank: each head's "
                                  "rotated query/key features (even; the key's shared)")
    v_head_dim: int = Field(0, ge=0, description="with kv_lora_rank: each head's value "
                            "width")
    rope_interleave: bool = Field(False, description="with kv_lora_rank: the rotated "
                                  "features in interleaved pairs (DeepSeek-V3's weights)")
    dense_layers: list[int] = Field(default_factory=list, description="with n_experts: "
                                    "the blocks (from 0) whose MLP is the dense SwiGLU of "
                                    "width ffn_hidden instead of the mixture (DeepSeek's "
                                    "first_k_dense_replace, Qwen-MoE's mlp_only_layers); "
                                    "empty: the mixture in every block")
    rope_scaling: dict[str, float | int | str | list[float]] | None = Field(
        None, description="Llama 3's rotary frequency scaling, a table of factor, "
        "low_freq_factor, high_freq_factor, original_max_position_embeddings; with "
        "rope_type = \"linear\" every frequency divided by factor (Gemma 3's global "
        "layers); or with "
        "rope_type = \"longrope\" Phi-3's LongRoPE, short_factor and long_factor (one per "
        "rotary frequency), original_max_position_embeddings (block_size at most it: the "
        "short factors only), attention_factor; or with rope_type = \"yarn\" and "
        "model.kv_lora_rank, DeepSeek's YaRN: factor, original_max_position_embeddings, "
        "beta_fast, beta_slow, mscale, mscale_all_dim; unset: none")
    head_dim: int = Field(0, ge=0, json_schema_extra=ZERO_MEANS_UNSET,
                          description="each attention head's width D (Q is n_head x D wide, K "
                                      "and V n_kv_heads x D; Qwen3's may differ from n_embd / "
                                      "n_head); even; 0: n_embd / n_head")
    qkv_bias: bool = Field(False, json_schema_extra=GQA_ONLY,
                           description="biases on the Q, K and V projections (Qwen2)")
    qk_norm: bool = Field(False, json_schema_extra=GQA_ONLY,
                          description="an RMSNorm over each head's D features of Q and of K "
                                      "before the rotary embedding (Qwen3's q_norm, k_norm)")
    rotary_dim: int = Field(0, ge=0, json_schema_extra=UNSET_GQA_ONLY,
                            description="rotate only the first rotary_dim of each head's D "
                                        "features, the rest passed through (Phi-3's "
                                        "partial_rotary_factor = rotary_dim / D: Phi-4-mini's "
                                        "0.75); even, at most D; 0: all D")
    sliding_window: int = Field(0, ge=0, json_schema_extra=UNSET_GQA_ONLY,
                                description="sliding-window attention, each token attending to "
                                            "the previous sliding_window tokens (its own "
                                            "included; Mistral 7B's 4096), on the layers "
                                            "layer_types marks sliding_attention (all when "
                                            "unset); 0: none")
    layer_types: list[str] | None = Field(None, description="with sliding_window: per "
                                          "layer, sliding_attention or full_attention "
                                          "(transformers' layer_types); unset: every layer "
                                          "sliding_attention")
    norm_zero_centered: bool = Field(False, json_schema_extra=GQA_ONLY,
                                     description="every RMSNorm's weight w stored zero-centred, "
                                                 "scaling by 1 + w in fp32, w starting at 0 "
                                                 "(Gemma's; Megatron-Core's "
                                                 "layernorm_zero_centered_gamma)")
    scale_embedding: bool = Field(False, description="the embedding's output times "
                                  "sqrt(n_embd), rounded to its dtype (Gemma's normalizer)")
    mlp_activation: str = Field("silu", description="the gated MLP's activation, silu "
                                "(SwiGLU) or gelu_tanh (GeGLU: Gemma's gelu_pytorch_tanh)")
    sandwich_norm: bool = Field(False, description="norms on the attention's and "
                                "the MLP's outputs too (Gemma 2/3: post_attention_layernorm "
                                "on the attention's output, pre_feedforward_layernorm and "
                                "post_feedforward_layernorm around the MLP)")
    query_pre_attn_scalar: float = Field(0.0, ge=0.0, json_schema_extra=UNSET_GQA_ONLY,
                                         description="the attention scores scaled by "
                                                     "query_pre_attn_scalar ** -0.5 (Gemma 2/3); "
                                                     "0: head_dim's")
    attn_logit_softcapping: float = Field(0.0, ge=0.0, json_schema_extra=UNSET_GQA_ONLY,
                                          description="the attention scores S become c tanh(S / "
                                                      "c), written out, not fused (Gemma 2's 50; "
                                                      "not with parallel.cp > 1); 0: none")
    final_logit_softcapping: float = Field(0.0, ge=0.0, json_schema_extra=ZERO_MEANS_UNSET,
                                           description="the logits z become c tanh(z / c) (Gemma "
                                                       "2's 30); 0: none")
    rope_local_base_freq: float = Field(0.0, ge=0.0, json_schema_extra=ZERO_MEANS_UNSET,
                                        description="the rotary base of the sliding_attention "
                                                    "layers, which take no rope_scaling (Gemma "
                                                    "3's 10000); 0: rope_theta and rope_scaling "
                                                    "on every layer")

    @model_validator(mode="after")
    def _llama_rules(self):
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim}: expected an even number "
                             "(rotary pairs per head), or 0")
        if self.rotary_dim % 2:
            raise ValueError(f"model.rotary_dim={self.rotary_dim}: expected an even number "
                             "(rotary pairs per head), or 0")
        if self.n_experts and self.top_k > self.n_experts:
            raise ValueError(f"model.top_k={self.top_k} is more than model.n_experts="
                             f"{self.n_experts}")
        if self.moe_gating not in ("softmax", "sigmoid"):
            raise ValueError(f"model.moe_gating={self.moe_gating!r}: expected softmax or sigmoid")
        if self.moe_group_score not in ("top2", "top1"):
            raise ValueError(f"model.moe_group_score={self.moe_group_score!r}: expected top2 "
                             "or top1")
        bad = [i for i in self.dense_layers if not 0 <= i < self.n_layer]
        if bad:
            raise ValueError(f"model.dense_layers: {bad[0]} is not a block index from 0 to "
                             f"model.n_layer - 1 = {self.n_layer - 1}")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"model.mlp_activation={self.mlp_activation!r}: expected "
                             f"{' or '.join(MLP_ACTIVATIONS)}")
        return self

    @property
    def experts(self) -> int:
        return self.n_experts

    def context_parallel_refusal(self, cp: int, a2a: int = 1) -> str | None:
        ring = a2a < cp  # some keys reached by ring attention (the engine's description
        # of such a Llama says so: ModelDescription.ring_attention, which the planner reads)
        if self.kv_lora_rank and ring:
            return (f"model.kv_lora_rank={self.kv_lora_rank} with parallel.cp={cp}: ring "
                    "attention carries keys and values of one head width, MLA's values are "
                    "v_head_dim wide; use cp = 1 or parallel.cp_comm = \"all_to_all\"")
        shared = super().context_parallel_refusal(cp, a2a)
        if shared or not self.attn_logit_softcapping or not ring:
            return shared
        return (f"model.attn_logit_softcapping={self.attn_logit_softcapping} with "
                f"parallel.cp={cp}: ring attention's block kernels have no soft cap; use "
                "cp = 1 or parallel.cp_comm = \"all_to_all\"")


class ModelConfig(LlamaModelConfig, GPTModelConfig):
    """Every decoder field of shardwise's kinds (the GPT's and the Llama's): the section of
    a kind registered with a config type of its own, and of an ``init_from`` run before its
    config.json names the kind (``section_class``)."""

    label: ClassVar[str] = "this model"
    refusals: ClassVar[dict[str, str]] = {}


# model.kind -> its section class: the kinds a config may name (read at the door, before
# torch: models' registry adds each kind it registers, ModelConfig for a config type of its own)
_SECTIONS: dict[str, type[ModelSection]] = {"gpt": GPTModelConfig, "llama": LlamaModelConfig,
                                            "cnn": ModelSection}


def register_section(kind: str, cls: type[ModelSection] | None = None) -> None:
    """Make ``cls`` the ``[model]`` section of ``model.kind = kind`` (``register_model`` calls
    it for every kind: None, a config type of the kind's own, keeps the section a name
    already has, else ``ModelConfig``)."""
    if cls is not None:
        _SECTIONS[kind] = cls
    else:
        _SECTIONS.setdefault(kind, ModelConfig)


def unknown_kind(name: str, kinds: tuple[str, ...]) -> str:
    """The one line for ``model.kind = name`` when no kind of ``kinds`` is it, with the
    nearest as a guess."""
    close = difflib.get_close_matches(name, kinds, n=1)
    guess = f"did you mean {close[0]!r}, or " if close else ""
    return (f"model.kind={name!r}: not a registered model ({', '.join(kinds)}); {guess}set "
            "model.module to the module that registers it with shardwise.register_model")


def section_class(kind: str) -> type[ModelSection]:
    """The section class of ``kind``: its registered one; ``ModelConfig`` for a kind with
    none (registered with a config type of its own, or not yet imported)."""
    return _SECTIONS.get(kind, ModelConfig)


def model_section(data: dict[str, Any]) -> ModelSection:
    """The ``[model]`` table ``data`` validated by its kind's class, after importing
    ``module`` (it may register the kind). A field of another of shardwise's kinds is
    dropped when it holds that kind's default (a dump of ``ModelConfig``, an old flat
    table), else refused in one line naming it (``ValueError``); pydantic's
    ``ValidationError`` for the rest."""
    import_model_module(data.get("module", ""))
    explicit = "kind" in data
    kind = data.get("kind", "gpt")
    if isinstance(kind, str) and kind not in _SECTIONS:  # before torch: the door's answer
        raise ValueError(unknown_kind(kind, tuple(_SECTIONS)))
    cls = ModelConfig if data.get("init_from") and not explicit else section_class(kind)
    return cls.model_validate(own_fields(data, cls))


def own_fields(data: dict[str, Any], cls: type[ModelSection]) -> dict[str, Any]:
    """``data`` less the fields of shardwise's other kinds that hold their defaults (names
    no kind has are kept, for pydantic to name); ``ValueError`` (one line) for such a field
    set to another value: ``cls.refusals``' message, else "the GPT has no such option"."""
    known, every = cls.model_fields, ModelConfig.model_fields
    table = {}
    for name, value in data.items():
        if name in known or name not in every:
            table[name] = value
        elif value != every[name].get_default(call_default_factory=True):
            other = "llama" if name in LlamaModelConfig.model_fields else "gpt"
            text = cls.refusals.get(name) or (f"model.{name}={{value}}: {cls.label} has no "
                                              f"such option (model.kind = \"{other}\" has)")
            raise ValueError(text.format(value=value))
    return table


def section_dataclass(name: str, section: type[ModelSection], positional: tuple[str, ...],
                      defaults: dict[str, Any] | None = None) -> type:
    """A frozen dataclass of ``section``'s model fields (not ``kind``, ``module``,
    ``init_from``), for a model's Python config: ``vocab_size`` first and required, then
    ``positional`` in that order (callers may pass those by position), then the rest in
    the section's order; each default the section's (``defaults`` for the few the Python
    API sets otherwise), None where the section writes 0 for "unset"
    (``ZERO_MEANS_UNSET``), a tuple for a list. Its ``__post_init__`` does nothing, so a
    subclass's is called."""
    fields = {n: i for n, i in section.model_fields.items()
              if n not in ("kind", "module", "init_from", "vocab_size")}
    defaults = defaults or {}

    def one(n: str) -> tuple:
        info = fields[n]
        default = defaults.get(n, info.get_default(call_default_factory=True))
        kind = getattr(info.annotation, "__name__", str(info.annotation))
        if zero_means_unset(info) or default is None:
            return n, f"{kind} | None", dataclasses.field(default=None)
        if isinstance(default, list):
            return n, "tuple", dataclasses.field(default=tuple(default))
        return n, kind, dataclasses.field(default=default)

    order = [*positional, *(n for n in fields if n not in positional)]
    return dataclasses.make_dataclass(name, [("vocab_size", "int"), *map(one, order)],
                                      frozen=True,
                                      namespace={"__post_init__": lambda self: None})


def import_model_module(spec: str) -> ModuleType | None:
    """Import ``spec`` (``model.module``): a module name (``mypkg.models``, found on
    ``sys.path``) or a path to a ``.py`` file (relative to the working directory), and
    return it; "" imports nothing (None). Importing runs the module's code: that is how it
    registers its models (``register_model`` at import time). A file is imported once per
    process, as a module named after its stem (``examples/own_decoder.py`` ->
    ``own_decoder``), so every rank's import gives the same names. Raises ``ValueError``
    (one line naming ``model.module``) for a missing file or module, a name taken by another
    file, or any exception the module raises while it is imported."""
    if not spec:
        return None
    try:
        if spec.endswith(".py") or "/" in spec or "\\" in spec:
            return _import_file(spec)
        return importlib.import_module(spec)
    except ValueError:
        raise
    except Exception as e:  # the user's code: any error, as one line
        text = str(e).strip().splitlines()
        detail = f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
        raise ValueError(f"model.module={spec!r}: cannot import it ({detail})") from None


def _import_file(spec: str) -> ModuleType:
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"model.module={spec!r}: no such file")
    path = path.resolve()
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        where = getattr(loaded, "__file__", None)
        if where is not None and Path(where).resolve() == path:
            return loaded  # imported already (by this function or by its name)
        raise ValueError(f"model.module={spec!r}: a module named {name!r} is already "
                         f"imported from {where or 'elsewhere'}; rename the file")
    if not name.isidentifier():
        raise ValueError(f"model.module={spec!r}: {path.name} is not a module name")
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before running it: dataclasses look their module up
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
