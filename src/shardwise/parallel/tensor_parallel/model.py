"""The GPT's layers of ``shardwise.models.gpt``, each split across a tensor-parallel group.

Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053, section 3, figure 3): in each block the
MLP is ``fc`` column-parallel then ``proj`` row-parallel (one all-reduce forward, one
backward), attention is parallel across heads (Q, K, V column-parallel by heads, the output
projection row-parallel), LayerNorms, residuals and the position embedding are replicated,
the token embedding is vocab-parallel and so is the LM head, whose logits go straight into
the vocab-parallel cross-entropy. Under ``tp.sequence_parallel`` (Korthikanti et al. 2022,
arXiv:2205.05198) the residual stream is (B, T / tp, C) between the parallel regions.

``parallelize_layer(name, layer, tp, rng, vocab_size)`` is the GPT's tp plan: it maps one
layer of the unsharded GPT (``Embedding``, ``Block``, ``LMHead``) to its sharded
counterpart, copying this rank's slices out of it, so the sharded layers equal, slice for
slice, those of the GPT they came from. A layer on the meta device gives a sharded layer on
the meta device (the engine shards before it materialises; ``models.meta_init``). ``engine.model.build_local_model`` applies it to the
layers of this rank's pipeline chunks (and ties the head to the embedding where both sit
on one stage). Parameter names stay the unsharded layer's names.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.models.gpt import Block, Embedding, GPTConfig, LMHead, causal_attention
from shardwise.parallel.tensor_parallel.group import RankGroup
from shardwise.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    padded_vocab_size,
)
from shardwise.parallel.tensor_parallel.random import ParallelRNG, TPDropout


def check_divisible(cfg: GPTConfig, tp: RankGroup, seq_len: int | None = None) -> None:
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

    def __init__(self, master, tp: RankGroup, rng: ParallelRNG, tag: str):
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

    def __init__(self, master, tp: RankGroup, rng: ParallelRNG, tag: str):
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

    def __init__(self, master, tp: RankGroup, rng: ParallelRNG, tag: str):
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

    def __init__(self, master, tp: RankGroup, rng: ParallelRNG):
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
    """Replicated final LayerNorm, vocab-parallel projection. (B, T, C) -> (B, T, V_pad / tp),
    V_pad the vocabulary padded to a multiple of tp (``padded_vocab_size``); the padded
    columns' weights are zero."""

    def __init__(self, master, tp: RankGroup, vocab_size: int):
        super().__init__()
        self.ln_f = copy.deepcopy(master.ln_f)
        c, padded = master.proj.in_features, padded_vocab_size(vocab_size, tp.size)
        full = nn.Linear(c, padded, bias=False, device=master.proj.weight.device)
        with torch.no_grad():
            full.weight.zero_()
            full.weight[:vocab_size] = master.proj.weight
        self.proj = ColumnParallelLinear(c, padded, tp, bias=False, master=full, tag="head.proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln_f(x))


def parallelize_layer(name: str, layer: nn.Module, tp: RankGroup, rng: ParallelRNG,
                      vocab_size: int) -> nn.Module:
    """The tp-sharded counterpart of one GPT layer (named ``name`` in the GPT: "embed",
    "blocks.i", "head"; the name tags its collectives for ``mappings.per_layer_table``):
    ``Embedding`` -> ``TPEmbedding``, ``Block`` -> ``TPBlock``, ``LMHead`` -> ``TPHead``.
    ``rng`` draws the dropout masks of parallel regions. Raises ``TypeError`` for any other
    module and ``ValueError`` (one line, naming the size) when tp does not divide a size."""
    if isinstance(layer, Embedding):
        return TPEmbedding(layer, tp, rng)
    if isinstance(layer, Block):
        return TPBlock(layer, tp, rng, name)
    if isinstance(layer, LMHead):
        return TPHead(layer, tp, vocab_size)
    raise TypeError(f"no tensor-parallel plan for layer {name!r} ({type(layer).__name__})")
