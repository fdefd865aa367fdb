"""Parallel branches: an Inception block's independent branches on different ranks, joined
after (seed 002, "Model Parallelism": "some architectures (e.g. Inception family) have
multiple layers executed independently from each other, which you can easily assign to
different devices"; Szegedy et al. 2015, arXiv:1409.4842 for the block).

Every rank runs its branches (``cost.place_branches``) on the whole batch, then the feature
maps are all-gathered along the channels (full layout out) or exchanged all-to-all (batch
layout out: each rank gets its B/N samples of every channel), and put back in the block's
concatenation order. Conjugate operators carry all the communication, via ``shardwise.comm``:

=====================  ================================  =================================
operator               forward                           backward
=====================  ================================  =================================
copy_to_branches       full input: identity              all-reduce of the input gradient
                       batch input: all-gather along     (each rank's branches give a part
                       dim 0                             of it); batch: reduce-scatter
                                                         along dim 0 instead
gather_branches        all-gather along the channels     keep my branches' channels of the
                       (parts padded to the largest      gradient (no communication: in the
                       rank's), branches in block order  full layout every rank holds it all)
all_to_all_branches    all-to-all: rank j gets its B/N   all-to-all back: each rank its
                       rows of every rank's channels     branches' channels of every row
=====================  ================================  =================================

The first pair is Megatron's f (identity forward, all-reduce backward; Shoeybi et al. 2019,
arXiv:1909.08053, section 3) in front of the column-parallel all-gather that joins split
output features, with filter groups of unequal sizes. Bytes each rank sends per step, ring
algorithms, fp32, B the global batch, N ranks, H x W the block's side, c_in its input
channels, c_max the most output channels any rank computes::

    2 (N-1)/N x 4 B c_in H W   (input gradient: all-reduce, or all-gather + reduce-scatter)
  +   (N-1)   x 4 B c_max H W  (full out: all-gather of N padded parts of 4 B c_max H W)
  or 2 (N-1)/N x 4 B c_max H W (batch out: all-to-all forward and backward, padded parts)

against data parallelism's 2 (N-1)/N x 4 P for the block's P parameters.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardwise import comm
from shardwise.apps.cnn.layout import BATCH, FULL
from shardwise.models.cnn import Inception
from shardwise.parallel.tensor_parallel import RankGroup


class _CopyToBranches(torch.autograd.Function):
    """Full input: identity forward, all-reduce backward. Batch input (B/N rows): all-gather
    along dim 0 forward, reduce-scatter along dim 0 backward."""

    @staticmethod
    def forward(ctx, x, ranks: RankGroup, layout_in: str):
        ctx.ranks, ctx.batch = ranks, layout_in == BATCH
        if not ctx.batch:
            return x.view_as(x)
        out = x.new_empty((ranks.size,) + tuple(x.shape))
        comm.all_gather_into_tensor(out, x.contiguous(), group=ranks.group,
                                    algorithm=ranks.gather, check=ranks.check)
        return out.flatten(0, 1)                                   # (B, c_in, H, W)

    @staticmethod
    def backward(ctx, g):
        r = ctx.ranks
        if not ctx.batch:
            g = g.contiguous().clone()
            comm.all_reduce(g, group=r.group, algorithm=r.all_reduce, check=r.check)
            return g, None, None
        stacked = g.contiguous().view((r.size, g.shape[0] // r.size) + tuple(g.shape[1:]))
        out = g.new_empty(stacked.shape[1:])                       # (B/N, c_in, H, W)
        comm.reduce_scatter_tensor(out, stacked, group=r.group, algorithm=r.gather,
                                   check=r.check)
        return out, None, None


def _padded(y: torch.Tensor, c_max: int) -> torch.Tensor:
    """(b, c, H, W) -> (b, c_max, H, W), zeros after the c channels (contiguous)."""
    pad = y.new_zeros((y.shape[0], c_max - y.shape[1]) + tuple(y.shape[2:]))
    return torch.cat([y, pad], dim=1).contiguous()


def _in_block_order(parts: torch.Tensor, placement, channels) -> torch.Tensor:
    """(N, b, c_max, H, W), part r rank r's branches in its order -> (b, C, H, W)."""
    where = {}  # branch -> (rank, offset in that rank's part)
    for r, mine in enumerate(placement):
        off = 0
        for j in mine:
            where[j], off = (r, off), off + channels[j]
    return torch.cat([parts[r, :, o:o + channels[j]] for j, (r, o) in sorted(where.items())],
                     dim=1)


def _channels_of(g: torch.Tensor, mine, channels, c_pad: int) -> torch.Tensor:
    """(b, C, H, W) -> (b, c_pad, H, W): the channels of branches ``mine``, then zeros."""
    starts = [sum(channels[:j]) for j in range(len(channels))]
    return _padded(torch.cat([g[:, :0]] + [g[:, starts[j]:starts[j] + channels[j]]
                              for j in mine], dim=1), c_pad)


class _GatherBranches(torch.autograd.Function):
    """All-gather of every rank's branch outputs along the channels forward (block order);
    this rank's branches' channels of the gradient backward."""

    @staticmethod
    def forward(ctx, y, ranks: RankGroup, placement, channels):
        c_max = max(sum(channels[j] for j in mine) for mine in placement)
        part = _padded(y, c_max)                                   # (B, c_max, H, W)
        out = y.new_empty((ranks.size,) + tuple(part.shape))       # (N, B, c_max, H, W)
        comm.all_gather_into_tensor(out, part, group=ranks.group, algorithm=ranks.gather,
                                    check=ranks.check)
        ctx.mine, ctx.channels, ctx.c_r = placement[ranks.rank], channels, y.shape[1]
        return _in_block_order(out, placement, channels)           # (B, C, H, W)

    @staticmethod
    def backward(ctx, g):
        return _channels_of(g, ctx.mine, ctx.channels, ctx.c_r), None, None, None


def _a2a(ranks: RankGroup) -> str:
    """The all-to-all algorithm: the backend's where the group's gathers are, else ours
    (pairwise: N-1 steps, every byte counted by ``comm.accounting``)."""
    return "native" if ranks.gather == "native" else "pairwise"


class _AllToAllBranches(torch.autograd.Function):
    """All-to-all forward: every rank's branch outputs (B, c_r) -> this rank's B/N samples of
    every channel, block order; the reverse all-to-all backward."""

    @staticmethod
    def forward(ctx, y, ranks: RankGroup, placement, channels):
        n, c_max = ranks.size, max(sum(channels[j] for j in mine) for mine in placement)
        out = y.new_empty((y.shape[0], c_max) + tuple(y.shape[2:]))  # block i: rank i's
        comm.all_to_all_single(out, _padded(y, c_max), group=ranks.group, algorithm=_a2a(ranks),
                               check=ranks.check)
        ctx.ranks, ctx.placement, ctx.channels = ranks, placement, channels
        ctx.c_r, ctx.c_max = y.shape[1], c_max
        return _in_block_order(out.view((n, -1) + tuple(out.shape[1:])), placement,
                               channels)                           # (B/N, C, H, W)

    @staticmethod
    def backward(ctx, g):
        parts = torch.cat([_channels_of(g, mine, ctx.channels, ctx.c_max)
                           for mine in ctx.placement])             # (B, c_max, H, W)
        out = torch.empty_like(parts)                              # block i: my rows of rank i
        comm.all_to_all_single(out, parts, group=ctx.ranks.group, algorithm=_a2a(ctx.ranks),
                               check=ctx.ranks.check)
        return out[:, :ctx.c_r].contiguous(), None, None, None


def copy_to_branches(x: torch.Tensor, ranks: RankGroup, layout_in: str) -> torch.Tensor:
    """(B, ...) or, from the batch layout, (B/N, ...) -> (B, ...) for this rank's branches
    (see the module's table)."""
    return _CopyToBranches.apply(x, ranks, layout_in)


def gather_branches(y: torch.Tensor, ranks: RankGroup, placement, channels) -> torch.Tensor:
    """(B, c_r, H, W) of this rank's branches -> (B, C, H, W) of all, in block order.
    ``placement[r]``: the branch indices rank r computes; ``channels[j]``: branch j's."""
    return _GatherBranches.apply(y, ranks, placement, tuple(channels))


def all_to_all_branches(y: torch.Tensor, ranks: RankGroup, placement,
                        channels) -> torch.Tensor:
    """(B, c_r, H, W) of this rank's branches -> (B/N, C, H, W): this rank's samples of all
    branches, in block order (arguments as ``gather_branches``)."""
    return _AllToAllBranches.apply(y, ranks, placement, tuple(channels))


class BranchParallel(nn.Module):
    """The ``Inception`` block with this rank's branches only (``placement[rank]``); input in
    ``layout_in`` (batch or full), output in ``layout_out`` (full: ``(B, C, H, W)``; batch:
    ``(B/N, C, H, W)``), before the block's ReLU. Parameter names are the full block's
    (``branches.{j}.conv.weight``)."""

    def __init__(self, full: Inception, placement, ranks: RankGroup, layout_in: str,
                 layout_out: str = FULL):
        super().__init__()
        if len(placement) != ranks.size:
            raise ValueError(f"branch placement for {len(placement)} ranks, the group has "
                             f"{ranks.size}")
        self.ranks, self.placement, self.layout_in = ranks, placement, layout_in
        self.join = all_to_all_branches if layout_out == BATCH else gather_branches
        self.channels = tuple(b.conv.out_channels for b in full.branches)
        self.branches = nn.ModuleDict({str(j): full.branches[j] for j in placement[ranks.rank]})
        # every branch's parameters: (name in the block, shape, owning rank), for full_state
        self.all_params = [(f"branches.{j}.{n}", p.shape, r) for r, mine in enumerate(placement)
                           for j in mine for n, p in full.branches[j].named_parameters()]
        self.all_params.sort(key=lambda t: t[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's branches on the whole batch, then every rank's joined."""
        h = copy_to_branches(x, self.ranks, self.layout_in)        # (B, c_in, H, W)
        mine = [self.branches[str(j)](h) for j in self.placement[self.ranks.rank]]
        # a rank without branches still passes h on, so its backward's collective runs
        y = torch.cat(mine, dim=1) if mine else h[:, :0]           # (B, c_r, H, W)
        return self.join(y, self.ranks, self.placement, self.channels)
