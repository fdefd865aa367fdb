"""Multi-head latent attention (MLA), DeepSeek-V2's and V3's attention.

DeepSeek-AI 2024, "DeepSeek-V2" (arXiv:2405.04434), sec. 2.1.2-2.1.3, and "DeepSeek-V3"
(arXiv:2412.19437), sec. 2.1.1; transformers' ``models/deepseek_v3/modeling_deepseek_v3.py``
(``DeepseekV3Attention``) for the tensor names and layouts. Keys and values come from one
low-rank latent per token: ``kv_a_proj_with_mqa`` (h -> r_kv + R) gives the compressed
latent c (r_kv = ``kv_lora_rank`` wide, normalised by ``kv_a_layernorm``) and one rotary
key k_R (R = ``qk_rope_head_dim``) shared by every head; ``kv_b_proj`` (r_kv -> H (D_nope +
D_v)) expands c to each head's position-free key (D_nope = ``qk_nope_head_dim``) and its
value (D_v = ``v_head_dim``). Queries likewise, through a latent of ``q_lora_rank``
(``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``) or one ``q_proj`` when there is none;
each head's query is D_nope position-free features and R rotated ones. The rotary
embedding is decoupled: only the last R features of a query and the shared k_R rotate.
A head's score is q . k over D_nope + R features, scaled by (D_nope + R)^-1/2, times YaRN's
mscale(factor, mscale_all_dim)^2 under YaRN (``models.llama.Yarn``: applied to the queries
before the kernel's own scale), and its output the softmax-weighted D_v-wide values.

``rope_interleave``: the rotated features pair up adjacently (see ``forward``). Tensor
parallelism (``models.llama.tp_plan``) splits the heads and replicates the down projections
and their norms ("partial_grad"); cp > 1 is refused (``base.config``). Both, with the
parity shown: docs/models.md, "shardwise's own" (the Llama's MLA paragraph).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardwise.models import sequence
from shardwise.models.gpt import causal_attention

# transformers' ``DeepseekV3RMSNorm(q_lora_rank)`` / ``(kv_lora_rank)``: its default epsilon,
# not the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., R) -> (..., R): features 0, 2, 4, ... then 1, 3, 5, ... (rotary pairs laid out
    interleaved -> "rotate_half"'s halves)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    """Causal multi-head latent attention. (B, T, C) -> (B, T, C) (module docstring).

    ``cfg``: a ``models.llama.LlamaConfig`` with ``kv_lora_rank`` > 0; ``norm`` the RMSNorm
    class, ``rope`` ``(cfg, T, device, dtype, positions) -> (cos, sin)`` each (T, R) and
    ``apply`` the rotation of (B, H, T, R) (``models.llama``'s, passed in so this module
    does not import it). Parameters, transformers' names: ``q_proj`` (H Dqk, C) or
    ``q_a_proj`` (r_q, C), ``q_a_layernorm`` (r_q,), ``q_b_proj`` (H Dqk, r_q);
    ``kv_a_proj_with_mqa`` (r_kv + R, C), ``kv_a_layernorm`` (r_kv,), ``kv_b_proj`` (H (D_nope
    + D_v), r_kv), ``o_proj`` (C, H D_v); Dqk = D_nope + R. No biases."""

    def __init__(self, cfg, norm, rope, apply):
        super().__init__()
        self.cfg, self._rope, self._apply = cfg, rope, apply
        h, heads = cfg.n_embd, cfg.n_head
        self.nope, self.rot, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.r_kv = cfg.kv_lora_rank
        qk = self.nope + self.rot
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = norm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.r_kv + self.rot, bias=False)
        self.kv_a_layernorm = norm(self.r_kv, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.r_kv, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=False)
        yarn = getattr(cfg.rope_scaling, "softmax_factor", None)
        self.softmax_factor = yarn() if yarn is not None else 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, C)`` -> ``(B, T, C)``: DeepSeek's multi-head latent attention (queries and
        keys/values through low-rank projections, a shared rotary key; arXiv:2405.04434)."""
        B, T, _ = x.shape
        if self.cfg.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        # a tensor-parallel rank holds -1 = its share of the heads
        q = q.view(B, T, -1, self.nope + self.rot).transpose(1, 2)    # (B, H, T, Dqk)
        q_pass, q_rot = q.split([self.nope, self.rot], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.r_kv, self.rot], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))              # (B, T, H (Dn + Dv))
        kv = kv.view(B, T, -1, self.nope + self.v_dim).transpose(1, 2)
        k_pass, v = kv.split([self.nope, self.v_dim], dim=-1)         # (B, H, T, Dn / Dv)
        k_rot = k_rot.view(B, 1, T, self.rot)                          # one key, every head
        # rope_interleave (DeepSeek's released weights: transformers' V3 default, and V2's
        # apply_rotary_emb rotating adjacent pairs as complex numbers): the R rotated features
        # pair up as (x0, x1), (x2, x3), ...; de-interleaved (evens, then odds) before the
        # "rotate_half" rotation, as transformers' apply_rotary_pos_emb_interleave, whose
        # output is that layout (queries and keys alike, so no score depends on it). Without
        # it: "rotate_half" on the R features as they are (pairs (x_i, x_{i + R/2})).
        if self.cfg.rope_interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        cos, sin = self._rope(self.cfg, T, x.device, x.dtype,         # (T, R) each
                              positions=sequence.positions(T, x.device))
        q_rot, k_rot = self._apply(q_rot, cos, sin), self._apply(k_rot, cos, sin)
        q = torch.cat([q_pass, q_rot], dim=-1)
        if self.softmax_factor != 1.0:  # YaRN's mscale on the scores (models.llama.Yarn)
            q = q * self.softmax_factor
        k = torch.cat([k_pass, k_rot.expand(-1, k_pass.shape[1], -1, -1)], dim=-1)
        p = self.cfg.dropout if self.training else 0.0
        y = causal_attention(q, k, v, p, self.cfg.attention)          # (B, H, T, Dv)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
