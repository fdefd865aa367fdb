"""The GPT of ``shardwise.models.gpt``, split across a tensor-parallel group.

Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053, section 3, figure 3): in each block the
MLP is ``fc`` column-parallel then ``proj`` row-parallel (one all-reduce forward, one
backward), attention is parallel across heads (Q, K, V column-parallel by heads, the output
projection row-parallel), LayerNorms, residuals and the position embedding are replicated,
the token embedding is vocab-parallel and tied to the vocab-parallel LM head, whose logits
go straight into the vocab-parallel cross-entropy. Under ``tp.sequence_parallel``
(Korthikanti et al. 2022, arXiv:2205.05198) the residual stream is (B, T / tp, C) between
the parallel regions.

``TPGPT(master, tp)`` copies this rank's slices out of an unsharded ``GPT`` (``master``);
``build_tp_gpt(cfg, tp, seed)`` builds that master from ``seed`` first, so the sharded
model equals, slice for slice, ``GPT(cfg)`` built after ``torch.manual_seed(seed)``.
Parameter names are the unsharded GPT's names.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.models.gpt import GPT, GPTConfig, causal_attention
from shardwise.parallel.tensor_parallel.group import TPGroup
from shardwise.parallel.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                              VocabParallelEmbedding, gather_tensor,
                                              padded_vocab_size)
from shardwise.parallel.tensor_parallel.loss import vocab_parallel_cross_entropy
from shardwise.parallel.tensor_parallel.random import ParallelRNG, TPDropout


def check_divisible(cfg: GPTConfig, tp: TPGroup, seq_len: int | None = None) -> None:
    """Raise ValueError naming the first size that tp does not divide."""
    tp.shard(cfg.n_head, "model.n_head (attention heads)")
    tp.shard(cfg.n_embd, "model.n_embd (hidden size)")
    tp.shard(4 * cfg.n_embd, "MLP size 4 * model.n_embd")
    if tp.sequence_parallel:
        tp.shard(cfg.block_size if seq_len is None else seq_len,
                 "sequence length (sequence parallelism splits it)")


class TPAttention(nn.Module):
    """Causal self-attention over this rank's n_head / tp heads. (B, T, C) -> (B, T, C);
    (B, T / tp, C) in and out under sequence parallelism."""

    def __init__(self, master, tp: TPGroup, rng: ParallelRNG, tag: str):
        super().__init__()
        c = master.q_proj.in_features
        self.tp, self.rng, self.head_dim = tp, rng, master.head_dim
        self.n_head_local = tp.shard(master.n_head, "model.n_head (attention heads)")
        mk = lambda name: ColumnParallelLinear(c, c, tp, getattr(master, name).bias is not None,
                                               master=getattr(master, name), tag=f"{tag}.qkv")
        self.q_proj, self.k_proj, self.v_proj = mk("q_proj"), mk("k_proj"), mk("v_proj")
        self.out_proj = RowParallelLinear(c, c, tp, master.out_proj.bias is not None,
                                          input_is_parallel=True, master=master.out_proj,
                                          tag=f"{tag}.out_proj")
        self.dropout, self.attention = master.dropout, master.attention
        self.resid_dropout = TPDropout(master.dropout, rng, parallel=tp.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.q_proj.enter(x)  # one f (or sequence all-gather) for Q, K and V: (B, T, C)
        B, T, _ = x.shape
        q, k, v = (p.local(x).view(B, T, self.n_head_local, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # (B, H / tp, T, D)
        p = self.dropout if self.training else 0.0
        if p > 0.0:
            with self.rng.fork():  # this rank's heads: a parallel region
                y = causal_attention(q, k, v, p, self.attention)
        else:
            y = causal_attention(q, k, v, 0.0, self.attention)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C / tp)
        return self.resid_dropout(self.out_proj(y))


class TPMLP(nn.Module):
    """``fc`` column-parallel (C -> 4C / tp), GELU, ``proj`` row-parallel (4C / tp -> C)."""

    def __init__(self, master, tp: TPGroup, rng: ParallelRNG, tag: str):
        super().__init__()
        self.fc = ColumnParallelLinear(master.fc.in_features, master.fc.out_features, tp,
                                       master.fc.bias is not None, master=master.fc,
                                       tag=f"{tag}.fc")
        self.proj = RowParallelLinear(master.proj.in_features, master.proj.out_features, tp,
                                      master.proj.bias is not None, input_is_parallel=True,
                                      master=master.proj, tag=f"{tag}.proj")
        self.dropout = TPDropout(master.dropout.p, rng, parallel=tp.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class TPBlock(nn.Module):
    """Pre-LayerNorm block; LayerNorms and residuals replicated (or sequence-split)."""

    def __init__(self, master, tp: TPGroup, rng: ParallelRNG, tag: str):
        super().__init__()
        self.ln_1 = copy.deepcopy(master.ln_1)  # registration order = the GPT's order
        self.attn = TPAttention(master.attn, tp, rng, f"{tag}.attn")
        self.ln_2 = copy.deepcopy(master.ln_2)
        self.mlp = TPMLP(master.mlp, tp, rng, f"{tag}.mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TPEmbedding(nn.Module):
    """Vocab-parallel token embedding + replicated position embedding. (B, T) -> (B, T, C),
    or (B, T / tp, C) under sequence parallelism (positions of this rank's slice)."""

    def __init__(self, master, tp: TPGroup, rng: ParallelRNG):
        super().__init__()
        self.tp = tp
        self.tok = VocabParallelEmbedding(master.tok.num_embeddings, master.tok.embedding_dim,
                                          tp, master=master.tok, tag="embed.tok")
        self.pos = copy.deepcopy(master.pos)
        self.dropout = TPDropout(master.dropout.p, rng, parallel=tp.sequence_parallel)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.tok(idx)
        if self.tp.sequence_parallel:
            n = self.tp.shard(T, "sequence length (sequence parallelism splits it)")
            pos = torch.arange(self.tp.rank * n, (self.tp.rank + 1) * n, device=idx.device)
        else:
            pos = torch.arange(T, device=idx.device)
        return self.dropout(x + self.pos(pos))


class TPHead(nn.Module):
    """Replicated final LayerNorm, vocab-parallel projection. -> (B, T, V_pad / tp)."""

    def __init__(self, master, tp: TPGroup, vocab_size: int, tied: nn.Parameter | None):
        super().__init__()
        self.ln_f = copy.deepcopy(master.ln_f)
        c, padded = master.proj.in_features, padded_vocab_size(vocab_size, tp.size)
        full = nn.Linear(c, padded, bias=False)
        with torch.no_grad():
            full.weight.zero_()
            full.weight[:vocab_size] = master.proj.weight
        self.proj = ColumnParallelLinear(c, padded, tp, bias=False, master=full, tag="head.proj")
        if tied is not None:
            self.proj.weight = tied  # the same vocab rows on the same rank: tying survives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln_f(x))


class TPGPT(nn.Module):
    """``embed -> blocks -> head`` on one tp rank. ``forward(idx (B, T), targets | None)``
    returns ``(logits (B, T, V_pad / tp): this rank's vocabulary columns, loss)``; the loss
    is the mean cross-entropy in nats per token over the real vocabulary, identical on every
    tp rank. ``gather_logits`` gives (B, T, V).

    Raises ValueError naming the size when heads, hidden size, MLP size (or, with sequence
    parallelism, the sequence length) are not divisible by tp.
    """

    def __init__(self, master: GPT, tp: TPGroup, seed: int = 0):
        super().__init__()
        cfg = self.cfg = master.cfg
        check_divisible(cfg, tp)
        self.tp = tp
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, tp.size)
        rng = self.rng = ParallelRNG(seed, tp.rank,
                                     next(master.parameters()).device)
        self.embed = TPEmbedding(master.embed, tp, rng)
        self.blocks = nn.ModuleList(TPBlock(b, tp, rng, f"blocks.{i}")
                                    for i, b in enumerate(master.blocks))
        self.head = TPHead(master.head, tp, cfg.vocab_size,
                           self.embed.tok.weight if cfg.tie_weights else None)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if idx.shape[1] > self.cfg.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size "
                             f"{self.cfg.block_size}")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)  # (B, T, V_pad / tp): sequence all-gathered under SP
        if targets is None:
            return logits, None
        return logits, vocab_parallel_cross_entropy(logits, targets, self.tp,
                                                    self.cfg.vocab_size, tag="head.loss")

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, T, V_pad / tp) local -> (B, T, V) on every rank (no autograd)."""
        return gather_tensor(logits, -1, self.tp)[..., :self.cfg.vocab_size]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 20, generator: torch.Generator | None = None) -> torch.Tensor:
        """``GPT.generate`` on the tp group: (B, T0) -> (B, T0 + new_tokens), the same ids
        on every tp rank when ``generator`` (or the default generator) is in step across
        them. Under sequence parallelism the context is right-padded to a multiple of tp;
        causal attention keeps the pads from reaching the positions that are read."""
        was_training = self.training
        self.eval()
        for _ in range(new_tokens):
            ctx = idx[:, -self.cfg.block_size:]
            t = ctx.shape[1]
            if self.tp.sequence_parallel and t % self.tp.size:
                pad = self.tp.size - t % self.tp.size
                ctx = torch.cat([ctx, ctx.new_zeros(ctx.shape[0], pad)], dim=1)
            logits = self.gather_logits(self(ctx)[0])[:, t - 1, :] / temperature  # (B, V)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        self.train(was_training)
        return idx

    def num_parameters(self) -> int:
        """Parameters held by this rank (shards and replicas)."""
        return sum(p.numel() for p in self.parameters())


def build_tp_gpt(cfg: GPTConfig, tp: TPGroup, seed: int) -> TPGPT:
    """``torch.manual_seed(seed)``, build the unsharded ``GPT(cfg)`` on this rank, keep this
    rank's slices. Every tp rank must pass the same seed. The full model exists briefly on
    each rank: fine at the sizes run here, and what makes parity exact by construction.
    Dropout of replicated regions uses the default generator afterwards, as seeded here.
    """
    check_divisible(cfg, tp)
    torch.manual_seed(seed)
    return TPGPT(GPT(cfg), tp, seed)
