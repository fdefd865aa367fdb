"""The communication of the convolution strategies, as conjugate autograd pairs.

A (B, C, H, W) feature map is split along the channels (dim 1: the ``feature`` layout of a
map) or along its rows (dim 2: the ``rows`` layout). Each operator is named by its forward /
backward pair; the backward is the adjoint of the forward, so a layer built from them is
differentiated exactly; on one rank each is the identity. Every byte goes through
``shardwise.comm``.

=================  ================================  ==================================
operator           forward                           backward
=================  ================================  ==================================
split_dim          keep my slice of dim d            all-gather along dim d
gather_dim         all-gather along dim d            keep my slice of dim d
halo_exchange      send my edge rows to the          send the halo rows' gradient back
                   neighbours, receive theirs        to their owners, add what comes
                   (zeros past the image's edges)    back onto my edge rows
=================  ================================  ==================================

The strategies (``shardwise.apps.cnn.conv``) pair them with tensor parallelism's f and g
(``shardwise.parallel.tensor_parallel.mappings``):

- filters (output channels split; Krizhevsky 2014, arXiv:1404.5997, section 3; Dryden et
  al., "Channel and Filter Parallelism for Large-Scale CNN Training", SC 2019): f on the
  input (identity forward, all-reduce of the input gradient backward), or from the batch
  layout an all-gather forward and a reduce-scatter backward; the maps leave channel-split
  and ``gather_dim(1)`` joins them along the channels where a layer needs them whole.
- channels (input channels split; Dryden et al. 2019, as above): each rank convolves its
  input channels, g sums the partial maps (all-reduce forward), or a reduce-scatter along
  the batch forward (all-gather backward) leaves them in the batch layout.
- spatial (a band of rows per rank; Dryden et al., "Improving Strong-Scaling of CNN Training
  by Exploiting Finer-Grained Parallelism", IPDPS 2019): ``halo_exchange`` before the
  convolution; the weights are replicated and their gradients summed as data parallelism's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.parallel.tensor_parallel import RankGroup


def _slice(x: torch.Tensor, dim: int, ranks: RankGroup) -> torch.Tensor:
    n = x.shape[dim]
    if n % ranks.size:
        raise ValueError(f"dim {dim} of size {n} is not divisible into {ranks.size} ranks")
    return x.narrow(dim, ranks.rank * (n // ranks.size), n // ranks.size).contiguous()


def _all_gather(x: torch.Tensor, dim: int, ranks: RankGroup) -> torch.Tensor:
    out = torch.empty((ranks.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, x.contiguous(), group=ranks.group, algorithm=ranks.gather,
                                check=ranks.check)
    return torch.cat(out.unbind(0), dim=dim)


class _SplitDim(torch.autograd.Function):
    """My slice of ``dim`` forward, all-gather along ``dim`` backward."""

    @staticmethod
    def forward(ctx, x, ranks, dim):
        ctx.ranks, ctx.dim = ranks, dim
        return _slice(x, dim, ranks)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.dim, ctx.ranks), None, None


class _GatherDim(torch.autograd.Function):
    """All-gather along ``dim`` forward (rank order), my slice backward."""

    @staticmethod
    def forward(ctx, x, ranks, dim):
        ctx.ranks, ctx.dim = ranks, dim
        return _all_gather(x, dim, ranks)

    @staticmethod
    def backward(ctx, g):
        return _slice(g, ctx.dim, ctx.ranks), None, None


def split_dim(x: torch.Tensor, ranks: RankGroup, dim: int) -> torch.Tensor:
    """(.., n, ..) -> (.., n / N, ..) along ``dim``: my slice forward, all-gather backward."""
    return x if ranks.size == 1 else _SplitDim.apply(x, ranks, dim)


def gather_dim(x: torch.Tensor, ranks: RankGroup, dim: int) -> torch.Tensor:
    """(.., n / N, ..) -> (.., n, ..) along ``dim``: all-gather forward, my slice backward."""
    return x if ranks.size == 1 else _GatherDim.apply(x, ranks, dim)


def _neighbours(ranks: RankGroup) -> tuple[int | None, int | None]:
    """Global ranks of the bands above and below mine (None past the image's edges)."""
    glob = dist.get_process_group_ranks(ranks.group or dist.group.WORLD)
    r = ranks.rank
    return (glob[r - 1] if r > 0 else None), (glob[r + 1] if r < ranks.size - 1 else None)


def _swap(sends: list, recvs: list, ranks: RankGroup) -> None:
    """One round of the sends and receives that have rows in them."""
    s = [(t, p) for t, p in sends if p is not None and t.shape[2]]
    r = [(t, p) for t, p in recvs if p is not None and t.shape[2]]
    if s or r:
        comm.exchange(sends=s, recvs=r, group=ranks.group)


class _HaloExchange(torch.autograd.Function):
    """(B, C, h, W) -> (B, C, top + h + bottom, W): the ``top`` rows above my band and the
    ``bottom`` rows below it from my neighbours forward; their gradient sent back and added
    onto my edge rows backward."""

    @staticmethod
    def forward(ctx, x, ranks, top, bottom):
        ctx.ranks, ctx.top, ctx.bottom = ranks, top, bottom
        up, down = _neighbours(ranks)
        x = x.contiguous()
        b, c, h, w = x.shape
        above = x.new_zeros(b, c, top, w)
        below = x.new_zeros(b, c, bottom, w)
        # my first `bottom` rows are the upper band's lower halo, my last `top` its lower's upper
        _swap([(x[:, :, :bottom].contiguous(), up), (x[:, :, h - top:].contiguous(), down)],
              [(above, up), (below, down)], ranks)
        return torch.cat([above, x, below], dim=2)

    @staticmethod
    def backward(ctx, g):
        top, bottom = ctx.top, ctx.bottom
        up, down = _neighbours(ctx.ranks)
        g = g.contiguous()
        h = g.shape[2] - top - bottom
        gx = g[:, :, top:top + h].clone()
        from_up = g.new_zeros(g.shape[0], g.shape[1], bottom, g.shape[3])
        from_down = g.new_zeros(g.shape[0], g.shape[1], top, g.shape[3])
        _swap([(g[:, :, :top].contiguous(), up), (g[:, :, top + h:].contiguous(), down)],
              [(from_up, up), (from_down, down)], ctx.ranks)
        gx[:, :, :bottom] += from_up
        gx[:, :, h - top:] += from_down
        return gx, None, None, None


def halo_exchange(x: torch.Tensor, ranks: RankGroup, top: int, bottom: int) -> torch.Tensor:
    """(B, C, h, W) band of rows -> (B, C, top + h + bottom, W) with the neighbours' halo rows
    (zeros beyond the first and last band). Each rank sends ``bottom`` rows up and ``top``
    rows down (one side at the edges), as much again backward. ValueError if a halo is
    taller than the band (it would need a rank beyond the neighbour)."""
    if max(top, bottom) > x.shape[2]:
        raise ValueError(f"halo of {max(top, bottom)} rows is taller than the band of "
                         f"{x.shape[2]} rows")
    if ranks.size == 1:
        return torch.nn.functional.pad(x, (0, 0, top, bottom))
    return _HaloExchange.apply(x, ranks, top, bottom)
