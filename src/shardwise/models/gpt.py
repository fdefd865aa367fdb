"""Decoder-only GPT from separable building blocks.

Token + learned position embedding, ``n_layer`` pre-LayerNorm blocks (causal multi-head
self-attention, then a GELU MLP, each inside a residual), a final LayerNorm and an LM head,
tied to the token embedding or not. Follows Radford et al. 2019 (GPT-2) with the
residual-projection init scaled by 1/sqrt(2 * n_layer).

The pieces are kept apart on purpose: attention has separate Q, K, V and output
projections (tensor parallelism splits Q/K/V by heads as column-parallel and the output as
row-parallel), the MLP is ``fc`` then ``proj`` (column then row), and the model is
``embed -> blocks[i] -> head`` so pipeline parallelism can cut it into stages by layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    attention: str = "sdpa"  # "sdpa": fused kernels; "math": explicit softmax(QK^T)V


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                     impl: str = "sdpa") -> torch.Tensor:
    """Causal softmax(Q K^T / sqrt(D)) V over (B, H, T, D) tensors; returns (B, H, T, D).

    ``impl="sdpa"``: ``F.scaled_dot_product_attention``, which on CUDA dispatches to
    FlashAttention-2 (Dao 2023) or memory-efficient attention (Rabe & Staats 2021) and never
    materialises the (T, T) scores; on the CPU it is a fused kernel of the same maths.
    ``impl="math"``: the scores written out (B, H, T, T), as in Vaswani et al. 2017; the
    baseline ``benchmarks/gpu_mfu.py`` measures fused attention against.
    """
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    if impl != "math":
        raise ValueError(f"model.attention={impl!r}: expected 'sdpa' or 'math'")
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, T, T)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    att = F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    if dropout_p > 0.0:
        att = F.dropout(att, dropout_p)
    return att @ v


class CausalSelfAttention(nn.Module):
    """Multi-head attention with a causal mask. (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        # no key bias: q.(k + b) shifts every score of a query equally, so softmax ignores it
        # and its gradient is zero up to rounding, which Adam would amplify into noise
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.out_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.attention = cfg.attention
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, C) -> (B, H, T, D); the head axis is what tensor parallelism splits
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = causal_attention(q, k, v, self.dropout if self.training else 0.0, self.attention)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    """``fc`` (C -> 4C), GELU, ``proj`` (4C -> C). (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token + position embedding. (B, T) int64 -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.dropout(self.tok(idx) + self.pos(pos))


class LMHead(nn.Module):
    """Final LayerNorm and projection to the vocabulary. (B, T, C) -> (B, T, V) logits."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln_f(x))


class GPT(nn.Module):
    """``embed -> blocks -> head``. ``forward(idx (B, T), targets (B, T) | None)``.

    Returns ``(logits (B, T, V), loss)`` where ``loss`` is the mean cross-entropy in nats
    per token, or ``None`` without targets. Raises ``ValueError`` if ``T > block_size``.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = LMHead(cfg)
        if cfg.tie_weights:
            self.head.proj.weight = self.embed.tok.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("out_proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if idx.shape[1] > self.cfg.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size {self.cfg.block_size}")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits, None
        # the loss in fp32 even when the model computes in bf16/fp16 (mixed precision)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 20, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``new_tokens`` ids after ``idx`` (B, T0); returns (B, T0 + new_tokens)
        (``generate`` with this model's logits)."""
        was_training = self.training
        self.eval()
        idx = generate(lambda ctx: self(ctx)[0], idx, new_tokens, self.cfg.block_size,
                       temperature=temperature, top_k=top_k, generator=generator)
        self.train(was_training)
        return idx


@torch.no_grad()
def generate(logits_of: Callable[[torch.Tensor], torch.Tensor | None], idx: torch.Tensor,
             new_tokens: int, block_size: int, *, pad_to: int = 1,
             share: Callable[[torch.Tensor], None] | None = None, temperature: float = 0.8,
             top_k: int | None = 20, generator: torch.Generator | None = None) -> torch.Tensor:
    """Autoregressive sampling: ``idx`` (B, T0) int64 -> (B, T0 + new_tokens).

    Each step feeds the last ``block_size`` ids, right-padded with id 0 to a multiple of
    ``pad_to`` (sequence parallelism splits the sequence; causal attention keeps the pads
    from reaching the position read), to ``logits_of``, which returns the logits
    (B, T, V) or None on a rank that does not sample (a pipeline stage before the last);
    ``sample_next`` draws from the last real position. ``share(next_ids)`` (B, 1), if
    given, makes every rank agree in place (a broadcast from the sampling rank). Used by
    ``GPT.generate`` and ``engine.Engine.generate``: the same ids for the same
    ``generator`` state whatever the layout."""
    for _ in range(new_tokens):
        ctx = idx[:, -block_size:]
        t = ctx.shape[1]
        if t % pad_to:
            ctx = torch.cat([ctx, ctx.new_zeros(ctx.shape[0], pad_to - t % pad_to)], dim=1)
        logits = logits_of(ctx)
        if logits is None:
            nxt = torch.zeros(idx.shape[0], 1, dtype=torch.long, device=idx.device)
        else:
            nxt = sample_next(logits[:, t - 1, :], temperature, top_k, generator)
        if share is not None:
            share(nxt)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def sample_next(logits: torch.Tensor, temperature: float = 0.8, top_k: int | None = 20,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from last-position ``logits`` (B, V): temperature, then top-k, then
    a multinomial draw. Returns (B, 1) int64."""
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
