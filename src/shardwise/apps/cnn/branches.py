"""Parallel branches: an Inception block's independent branches on different ranks, joined
after (seed 002, "Model Parallelism": "some architectures (e.g. Inception family) have
multiple layers executed independently from each other, which you can easily assign to
different devices"; Szegedy et al. 2015, arXiv:1409.4842 for the block).

Every rank runs its branches (``cost.place_branches``) on the whole batch, then the feature
maps are all-gathered along the channels and put back in the block's concatenation order.
Two conjugate operators carry all the communication, through ``shardwise.comm``:

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
=====================  ================================  =================================

The pair is Megatron's f (identity forward, all-reduce backward; Shoeybi et al. 2019,
arXiv:1909.08053, section 3) in front of the column-parallel all-gather that joins split
output features, with filter groups of unequal sizes. Bytes each rank sends per step, ring
algorithms, fp32, B the global batch, N ranks, H x W the block's side, c_in its input
channels, c_max the most output channels any rank computes::

    2 (N-1)/N x 4 B c_in H W   (input gradient: all-reduce, or all-gather + reduce-scatter)
  +   (N-1)   x 4 B c_max H W  (all-gather of N padded parts of 4 B c_max H W bytes)

against data parallelism's 2 (N-1)/N x 4 P for the block's P parameters.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardwise import comm
from shardwise.apps.cnn.layout import BATCH
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


class _GatherBranches(torch.autograd.Function):
    """All-gather of every rank's branch outputs along the channels forward (block order);
    this rank's branches' channels of the gradient backward."""

    @staticmethod
    def forward(ctx, y, ranks: RankGroup, placement, channels):
        c_max = max(sum(channels[j] for j in mine) for mine in placement)
        part = y if y.shape[1] == c_max else torch.cat(
            [y, y.new_zeros((y.shape[0], c_max - y.shape[1]) + tuple(y.shape[2:]))], dim=1)
        out = y.new_empty((ranks.size,) + tuple(part.shape))       # (N, B, c_max, H, W)
        comm.all_gather_into_tensor(out, part.contiguous(), group=ranks.group,
                                    algorithm=ranks.gather, check=ranks.check)
        where = {}  # branch -> (rank, offset in that rank's part)
        for r, mine in enumerate(placement):
            off = 0
            for j in mine:
                where[j], off = (r, off), off + channels[j]
        ctx.mine, ctx.channels = placement[ranks.rank], channels
        return torch.cat([out[r, :, o:o + channels[j]] for j, (r, o) in sorted(where.items())],
                         dim=1)                                    # (B, C, H, W)

    @staticmethod
    def backward(ctx, g):
        starts = [sum(ctx.channels[:j]) for j in range(len(ctx.channels))]
        mine = [g[:, starts[j]:starts[j] + ctx.channels[j]] for j in ctx.mine]
        return (torch.cat(mine, dim=1) if mine else g[:, :0]).contiguous(), None, None, None


def copy_to_branches(x: torch.Tensor, ranks: RankGroup, layout_in: str) -> torch.Tensor:
    """(B, ...) or, from the batch layout, (B/N, ...) -> (B, ...) for this rank's branches
    (see the module's table)."""
    return _CopyToBranches.apply(x, ranks, layout_in)


def gather_branches(y: torch.Tensor, ranks: RankGroup, placement, channels) -> torch.Tensor:
    """(B, c_r, H, W) of this rank's branches -> (B, C, H, W) of all, in block order.
    ``placement[r]``: the branch indices rank r computes; ``channels[j]``: branch j's."""
    return _GatherBranches.apply(y, ranks, placement, tuple(channels))


class BranchParallel(nn.Module):
    """The ``Inception`` block with this rank's branches only (``placement[rank]``); input in
    ``layout_in`` (batch or full), output ``(B, C, H, W)`` in the full layout, before the
    block's ReLU. Parameter names are the full block's (``branches.{j}.conv.weight``)."""

    def __init__(self, full: Inception, placement, ranks: RankGroup, layout_in: str):
        super().__init__()
        if len(placement) != ranks.size:
            raise ValueError(f"branch placement for {len(placement)} ranks, the group has "
                             f"{ranks.size}")
        self.ranks, self.placement, self.layout_in = ranks, placement, layout_in
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
        return gather_branches(y, self.ranks, self.placement, self.channels)
