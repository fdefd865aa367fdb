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
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.base.model_config import MLP_ACTIVATIONS, LlamaModelConfig, own_fields
from shardwise.models import sequence
from shardwise.models.gpt import causal_attention
from shardwise.models.description import section_values
from shardwise.models.hf import LLAMA_PREFIXES, llama_hf_name
from shardwise.models.llama_config import (  # noqa: F401 (re-exported: models.llama's names)
    LAYER_TYPES,
    LinearRope,
    LlamaConfig,
    LongRope,
    RopeScaling,
    Yarn,
    _is_yarn,
    yarn_mscale,
)
from shardwise.models.moe import Experts, MoE
from shardwise.models.sampling import DecoderLM, generate  # noqa: F401 (re-exported)


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
ACTIVATIONS = dict(zip(MLP_ACTIVATIONS, (F.silu, lambda x: F.gelu(x, approximate="tanh"))))


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
        # ring attention carries neither MLA's narrower values nor a soft cap on the scores;
        # the all-to-all runs the Llama's own attention (parallel.context.ulysses)
        n_layer=cfg.n_layer, context_parallel=True,
        ring_attention=not cfg.kv_lora_rank and cfg.attn_logit_softcapping is None,
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
    own_fields(m.model_dump(), LlamaModelConfig)
    return LlamaConfig(vocab_size=m.vocab_size or vocab_size,
                       **section_values(m, LlamaConfig, skip=("vocab_size",)))

