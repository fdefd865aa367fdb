"""Token dispatch and combine of expert parallelism: all-to-all as an autograd function.

GShard (Lepikhin et al. 2020, arXiv:2006.16668, section 3.2) and DeepSpeed-MoE (Rajbhandari
et al. 2022, arXiv:2201.05596) route tokens to experts on other ranks with one all-to-all and
bring the results back with its reverse; Megatron-Core's ``MoEAlltoAllTokenDispatcher``
does it dropless, with uneven splits, as here. The ep group of P ranks holds E experts, L =
E / P per rank, rank j experts ``[j L, (j + 1) L)``.

``dispatch(x, counts, ep)``: ``x`` (M, C) this rank's token copies sorted by global expert,
``counts`` (E,) how many go to each expert. First the counts themselves are swapped (an
all-to-all of L int64 per pair: each rank learns how many rows every peer sends to each of
its local experts; the one host synchronisation of the layer), then the rows (``AllToAll``),
then they are regrouped from (source rank, local expert) order into (local expert, source
rank) order, so each local expert's rows are contiguous for the grouped GEMM. Returns the
rows, the local counts (L,) and the plan ``combine`` undoes: regroup back, reverse all-to-all,
the result (M, C) in ``x``'s order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise import comm
from shardwise.parallel.tensor_parallel.group import RankGroup


class AllToAll(torch.autograd.Function):
    """All-to-all forward (send ``in_rows[j]`` rows to rank j, receive ``out_rows[i]`` from
    rank i), the reverse all-to-all backward (its adjoint: the gradients go back the way the
    rows came). (S, *w) -> (R, *w)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_rows: list[int], in_rows: list[int],
                ep: RankGroup, algorithm: str) -> torch.Tensor:
        """All-to-all of rows: send ``in_rows[j]`` rows of ``x`` to rank j of ``ep``, receive
        ``out_rows[j]`` from it; returns ``(sum(out_rows), ...)``."""
        ctx.plan = (out_rows, in_rows, ep, algorithm)
        out = x.new_empty((sum(out_rows),) + tuple(x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=ep.group,
                               algorithm=algorithm, check=False)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """The inverse all-to-all on the gradient (the row counts swapped)."""
        out_rows, in_rows, ep, algorithm = ctx.plan
        gx = grad.new_empty((sum(in_rows),) + tuple(grad.shape[1:]))
        comm.all_to_all_single(gx, grad.contiguous(), in_rows, out_rows, group=ep.group,
                               algorithm=algorithm, check=False)
        return gx, None, None, None, None


@dataclass(frozen=True)
class Plan:
    """What ``combine`` needs: rows sent to / received from each ep rank, and the regrouping
    (``order[i]`` is the received row that goes to place i)."""

    send_rows: list[int]
    recv_rows: list[int]
    order: torch.Tensor


def _expert_major(recv: torch.Tensor) -> torch.Tensor:
    """``recv`` (P, L): rows from source i for local expert l, laid out source-major. The
    permutation that lays them out expert-major (by l, then source i)."""
    p, l = recv.shape
    flat = recv.reshape(-1)
    starts = flat.cumsum(0) - flat                         # each (i, l) block's first row
    blocks = torch.arange(p * l, device=recv.device).view(p, l).t().reshape(-1)  # l-major
    sizes = flat[blocks]
    first = torch.repeat_interleave(starts[blocks] - (sizes.cumsum(0) - sizes), sizes)
    return first + torch.arange(int(flat.sum()), device=recv.device)


def dispatch(x: torch.Tensor, counts: torch.Tensor, ep: RankGroup,
             algorithm: str = "native") -> tuple[torch.Tensor, torch.Tensor, Plan]:
    """Send each row of ``x`` (M, C), sorted by global expert (``counts`` (E,) int64 rows
    each), to the rank holding its expert. Returns this rank's rows (R, C) grouped by local
    expert, their counts (L,) and the ``Plan`` for ``combine``. Collective over ``ep``."""
    e = counts.numel()
    l = ep.shard(e, "model.n_experts")
    theirs = torch.empty_like(counts)                     # [i L + l]: rank i -> my expert l
    comm.all_to_all_single(theirs, counts, group=ep.group, algorithm=algorithm, check=False)
    recv = theirs.view(ep.size, l)
    rows = torch.stack([counts.view(ep.size, l).sum(1), recv.sum(1)]).tolist()  # host sync
    send_rows, recv_rows = rows
    y = AllToAll.apply(x, recv_rows, send_rows, ep, algorithm)     # (R, C), source-major
    order = _expert_major(recv)
    return y[order], recv.sum(0), Plan(send_rows, recv_rows, order)


def combine(y: torch.Tensor, plan: Plan, ep: RankGroup, algorithm: str = "native") -> torch.Tensor:
    """Inverse of ``dispatch``: the experts' results ``y`` (R, C) back to the ranks their
    tokens came from, in the order ``dispatch`` got them. (R, C) -> (M, C)."""
    back = y.new_zeros(y.shape).index_copy(0, plan.order, y)      # source-major again
    return AllToAll.apply(back, plan.send_rows, plan.recv_rows, ep, algorithm)
