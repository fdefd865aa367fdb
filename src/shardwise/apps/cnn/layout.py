"""Activation layouts between layers, and the explicit layout changes between them.

Every rank of the group holds one of four layouts of a (B, ...) activation:

========  =====================================  ============================
layout    what a rank holds                       produced by
========  =====================================  ============================
batch     B/N samples, every feature (sharded     data-parallel layers
          along the batch, dim 0)
full      all B samples, every feature            replicated layers,
          (replicated)                            row-parallel layers
feature   all B samples, 1/N of the features      column-parallel layers,
          (sharded along dim 1: the last dim of   filter-parallel convolutions
          a (B, C) activation, the channels of
          a (B, C, H, W) map)
rows      all B samples, a band of H/N rows of    spatial convolutions
          the map (sharded along dim 2)
========  =====================================  ============================

Gradient convention (what makes every layout exact): on every rank, the gradient of an
activation is the true gradient of the global mean loss with respect to the part the rank
holds. Data-parallel weight gradients are therefore partial sums over ranks (all-reduced
with ``op="sum"``), and each layout change's backward is the conjugate of its forward:

==================  ==============================  =================================
change              forward                         backward
==================  ==============================  =================================
batch -> full       all-gather along dim 0          keep my rows (``gather_batch``)
full -> batch       keep my rows                    all-gather along dim 0
                                                    (``scatter_to_sequence``, dim 0)
full -> feature     keep my features                all-gather along the last dim
                                                    (``scatter_to_region``)
feature -> full     all-gather along the last dim   keep my features
                                                    (``gather_from_region``)
full -> rows        keep my rows of the map         all-gather along dim 2
rows -> full        all-gather along dim 2          keep my rows of the map
                                                    (``conv_mappings``' pair)
==================  ==============================  =================================

A (B, C, H, W) map in the feature layout changes along the channels (dim 1) with
``conv_mappings``' split / gather pair; flattened to (B, C H W) it is the feature layout of
the fully connected layer that follows (a rank's channels are a contiguous slice of the
flattened features). Every other change (batch <-> feature, rows <-> batch or feature)
goes through full. Two changes are fused into the layer next to them
(``shardwise.apps.cnn.hybrid``), as sequence parallelism fuses them (Korthikanti et al. 2022,
arXiv:2205.05198): batch -> column-parallel is an all-gather forward and a reduce-scatter
backward (``gather_from_sequence`` on dim 0) in place of the column layer's all-reduce
backward; row-parallel -> batch is a reduce-scatter forward, all-gather backward
(``reduce_scatter_to_sequence`` on dim 0) in place of its all-reduce forward. All bytes go
through ``shardwise.comm`` (the operators of ``shardwise.parallel.tensor_parallel.mappings``).
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.apps.cnn.conv_mappings import gather_dim, split_dim
from shardwise.parallel.tensor_parallel import (
    RankGroup,
    gather_from_region,
    scatter_to_region,
    scatter_to_sequence,
)

BATCH, FULL, FEATURE, ROWS = "batch", "full", "feature", "rows"
LAYOUTS = (BATCH, FULL, FEATURE, ROWS)


class _GatherBatch(torch.autograd.Function):
    """All-gather along dim 0 forward (rank order), keep my rows backward."""

    @staticmethod
    def forward(ctx, x, ranks: RankGroup):
        ctx.ranks = ranks
        out = torch.empty((ranks.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        comm.all_gather_into_tensor(out, x.contiguous(), group=ranks.group, algorithm=ranks.gather)
        return out.flatten(0, 1)                                  # (N b, ...)

    @staticmethod
    def backward(ctx, g):
        n = g.shape[0] // ctx.ranks.size
        return g.narrow(0, ctx.ranks.rank * n, n).contiguous(), None


def gather_batch(x: torch.Tensor, ranks: RankGroup) -> torch.Tensor:
    """(B/N, ...) -> (B, ...): all-gather forward, my rows backward (identity for N = 1)."""
    return x if ranks.size == 1 else _GatherBatch.apply(x, ranks)


def my_rows(x: torch.Tensor, ranks: RankGroup, dim: int = 0) -> torch.Tensor:
    """This rank's 1/N slice along ``dim`` of a tensor that every rank holds (no
    communication; data and labels, which every rank reads itself)."""
    n = x.shape[dim] // ranks.size
    return x.narrow(dim, ranks.rank * n, n)


def my_part(x: torch.Tensor, layout: str, ranks: RankGroup) -> torch.Tensor:
    """This rank's part in ``layout`` of a (B, ...) input every rank holds (no communication:
    the images, which need no gradient)."""
    dim = {BATCH: 0, FULL: None, FEATURE: 1, ROWS: 2}[layout]
    return x if dim is None or ranks.size == 1 else my_rows(x, ranks, dim)


def convert(x: torch.Tensor, src: str, dst: str, ranks: RankGroup, tag: str = "") -> torch.Tensor:
    """Change ``x`` from layout ``src`` to ``dst`` (see the module's table)."""
    if src == dst or ranks.size == 1:
        return x
    if FULL not in (src, dst):  # through full
        return convert(convert(x, src, FULL, ranks, tag), FULL, dst, ranks, tag)
    if ROWS in (src, dst) or (FEATURE in (src, dst) and x.dim() > 2):  # a map's rows / channels
        dim = 2 if ROWS in (src, dst) else 1
        return gather_dim(x, ranks, dim) if dst == FULL else split_dim(x, ranks, dim)
    if (src, dst) == (BATCH, FULL):
        return gather_batch(x, ranks)
    if (src, dst) == (FULL, BATCH):
        return scatter_to_sequence(x, ranks, dim=0, tag=tag)
    if (src, dst) == (FULL, FEATURE):
        return scatter_to_region(x, ranks, tag=tag)
    if (src, dst) == (FEATURE, FULL):
        return gather_from_region(x, ranks, tag=tag)
    raise ValueError(f"unknown layout change {src!r} -> {dst!r}; layouts are {LAYOUTS}")
