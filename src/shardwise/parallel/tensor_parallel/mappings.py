"""The conjugate communication operators of tensor parallelism, as autograd functions.

Each operator is named by its forward / backward pair; the backward is the conjugate
(adjoint) of the forward, so a layer built from them is differentiated exactly. On a group
of one rank every operator is the identity. Megatron-LM (Shoeybi et al. 2019,
arXiv:1909.08053, section 3) calls the first two ``f`` and ``g``:

=========================  ====================  ==========================
operator                   forward               backward
=========================  ====================  ==========================
copy_to_region  (f)        identity              all-reduce
reduce_from_region  (g)    all-reduce            identity
scatter_to_region          keep my slice of the  all-gather along the last
                           last dim              dim
gather_from_region         all-gather along the  keep my slice of the last
                           last dim              dim
scatter_to_sequence        keep my slice of the  all-gather along the
                           sequence dim          sequence dim
gather_from_sequence       all-gather along the  reduce-scatter along the
                           sequence dim          sequence dim
reduce_scatter_to_sequence reduce-scatter along  all-gather along the
                           the sequence dim      sequence dim
=========================  ====================  ==========================

The last three are sequence parallelism's replacements of f and g (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198): an
all-reduce is a reduce-scatter followed by an all-gather, so the same bytes move while the
activations between the two are sharded along the sequence.

Every byte goes through ``shardwise.comm``. With ``comm.accounting`` enabled, each call made
here is also noted in ``layer_log`` as ``(tag, phase, record)`` so communication can be
reported per layer (``per_layer_table``). Like comm's own log, it grows while accounting is
on; callers clear it (``layer_log.clear()``) around what they measure.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise import comm
from shardwise.parallel.tensor_parallel.group import RankGroup

layer_log: list[tuple[str, str, object]] = []  # (layer tag, "forward"/"backward", CallRecord)


def _mark() -> int:
    """Where this call's records will start (comm's log length now)."""
    return len(comm.accounting.log.records)


def _note(tag: str, phase: str, start: int, collective: str, nbytes: int) -> None:
    """Attach to ``tag`` the record this call left: the last one since ``start`` with this
    collective and size (DDP's asynchronous bucket calls may land in between)."""
    if not comm.accounting.log.enabled:
        return
    for rec in reversed(comm.accounting.log.records[start:]):
        if rec.collective == collective and rec.nbytes == nbytes:
            layer_log.append((tag, phase, rec))
            return


# ---------------------------------------------------------------- raw collectives (no autograd)

def _all_reduce(x: torch.Tensor, tp: RankGroup, tag: str, phase: str) -> torch.Tensor:
    y = x.contiguous().clone()  # never reduce in place: autograd may still need x
    start = _mark()
    comm.all_reduce(y, group=tp.group, algorithm=tp.all_reduce, check=tp.check)
    _note(tag, phase, start, "all_reduce", y.numel() * y.element_size())
    return y


def _split(x: torch.Tensor, dim: int, tp: RankGroup) -> torch.Tensor:
    n = x.shape[dim]
    if n % tp.size:
        raise ValueError(f"dim {dim} of size {n} is not divisible by tp={tp.size}")
    return x.narrow(dim, tp.rank * (n // tp.size), n // tp.size).contiguous()


def _gather(x: torch.Tensor, dim: int, tp: RankGroup, tag: str, phase: str) -> torch.Tensor:
    out = torch.empty((tp.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    start = _mark()
    comm.all_gather_into_tensor(out, x.contiguous(), group=tp.group, algorithm=tp.gather,
                                check=tp.check)
    _note(tag, phase, start, "all_gather", out.numel() * out.element_size())
    return torch.cat(out.unbind(0), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, tp: RankGroup, tag: str,
                    phase: str) -> torch.Tensor:
    if x.shape[dim] % tp.size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by tp={tp.size}")
    stacked = torch.stack(x.chunk(tp.size, dim=dim))  # (N, ..., n/N, ...) contiguous
    out = torch.empty_like(stacked[0])
    start = _mark()
    comm.reduce_scatter_tensor(out, stacked, group=tp.group, algorithm=tp.gather,
                               check=tp.check)
    _note(tag, phase, start, "reduce_scatter", stacked.numel() * stacked.element_size())
    return out


# ---------------------------------------------------------------- autograd functions

class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, tag):
        ctx.tp, ctx.tag = tp, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.tp, ctx.tag, "backward"), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, tag):
        return _all_reduce(x, tp, tag, "forward")

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, tag):
        ctx.tp, ctx.tag = tp, tag
        return _split(x, -1, tp)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, -1, ctx.tp, ctx.tag, "backward"), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, tag):
        ctx.tp = tp
        return _gather(x, -1, tp, tag, "forward")

    @staticmethod
    def backward(ctx, g):
        return _split(g, -1, ctx.tp), None, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim, tag):
        ctx.tp, ctx.dim, ctx.tag = tp, dim, tag
        return _split(x, dim, tp)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.tp, ctx.tag, "backward"), None, None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim, tag):
        ctx.tp, ctx.dim, ctx.tag = tp, dim, tag
        return _gather(x, dim, tp, tag, "forward")

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.dim, ctx.tp, ctx.tag, "backward"), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim, tag):
        ctx.tp, ctx.dim, ctx.tag = tp, dim, tag
        return _reduce_scatter(x, dim, tp, tag, "forward")

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.tp, ctx.tag, "backward"), None, None, None


def _replayed_reduction(x: torch.Tensor, weight: torch.Tensor, tp: RankGroup) -> torch.Tensor:
    """The reduction of ``_LinearReduce`` when recomputed: the same collective on a buffer
    of its output's shape, which the replay fills; the partial sums are never formed."""
    shape = list(x.shape[:-1]) + [weight.shape[0]]                          # (..., out)
    if not tp.sequence_parallel:
        y = x.new_empty(shape)
        comm.all_reduce(y, group=tp.group, algorithm=tp.all_reduce, check=tp.check)
        return y
    full = x.new_empty(()).expand([tp.size] + shape[:1] + [shape[1] // tp.size] + shape[2:])
    out = x.new_empty(full.shape[1:])                                       # (B, T / N, out)
    comm.reduce_scatter_tensor(out, full, group=tp.group, algorithm=tp.gather, check=tp.check)
    return out


class _LinearReduce(torch.autograd.Function):
    """x W^T summed over tp (g, or SP's reduce-scatter) as one step: see ``linear_reduce``."""

    @staticmethod
    def forward(ctx, x, weight, tp, tag):
        ctx.tp, ctx.tag = tp, tag
        ctx.save_for_backward(x, weight)
        with comm.replay.hidden():  # neither kept nor counted by the selective checkpoint
            if comm.replay.recomputing():
                return _replayed_reduction(x, weight, tp)
            partial = F.linear(x, weight)                                   # (..., out)
            if tp.sequence_parallel:
                return _reduce_scatter(partial, 1, tp, tag, "forward")      # (B, T / N, out)
            return _all_reduce(partial, tp, tag, "forward")

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        if ctx.tp.sequence_parallel:
            g = _gather(g, 1, ctx.tp, ctx.tag, "backward")                # (B, T, out)
        # the products autograd takes for F.linear (mm's backward for its transposed weight)
        g2 = g.reshape(-1, g.shape[-1])
        gx = g2.mm(weight).view(x.shape)
        gw = g2.t().mm(x.reshape(-1, x.shape[-1]))
        return gx, gw, None, None


# ---------------------------------------------------------------- public operators

@torch.compiler.disable  # a collective: a compiled layer breaks here, it runs eagerly
def copy_to_region(x: torch.Tensor, tp: RankGroup, tag: str = "") -> torch.Tensor:
    """Identity forward, all-reduce backward (Megatron's f). Same shape in and out."""
    return x if tp.size == 1 else _CopyToRegion.apply(x, tp, tag)


@torch.compiler.disable  # a collective: a compiled layer breaks here, it runs eagerly
def reduce_from_region(x: torch.Tensor, tp: RankGroup, tag: str = "") -> torch.Tensor:
    """All-reduce (sum) forward, identity backward (Megatron's g). Same shape in and out."""
    return x if tp.size == 1 else _ReduceFromRegion.apply(x, tp, tag)


@torch.compiler.disable  # a collective: a compiled layer breaks here, it runs eagerly
def scatter_to_region(x: torch.Tensor, tp: RankGroup, tag: str = "") -> torch.Tensor:
    """(..., n) -> (..., n / tp): my slice forward, all-gather backward."""
    return x if tp.size == 1 else _ScatterToRegion.apply(x, tp, tag)


@torch.compiler.disable  # a collective: a compiled layer breaks here, it runs eagerly
def gather_from_region(x: torch.Tensor, tp: RankGroup, tag: str = "") -> torch.Tensor:
    """(..., n / tp) -> (..., n): all-gather forward (rank order), my slice backward."""
    return x if tp.size == 1 else _GatherFromRegion.apply(x, tp, tag)


@torch.compiler.disable  # a collective: a compiled layer breaks here, it runs eagerly
def scatter_to_sequence(x: torch.Tensor, tp: RankGroup, dim: int = 1,
                        tag: str = "") -> torch.Tensor:
    """(B, T, C) -> (B, T / tp, C): my sequence slice forward, all-gather backward."""
    return x if tp.size == 1 else _ScatterToSequence.apply(x, tp, dim, tag)


@torch.compiler.disable  # a collective: a compiled layer breaks here, it runs eagerly
def gather_from_sequence(x: torch.Tensor, tp: RankGroup, dim: int = 1,
                         tag: str = "") -> torch.Tensor:
    """(B, T / tp, C) -> (B, T, C): all-gather forward, reduce-scatter backward
    (sequence parallelism's f)."""
    return x if tp.size == 1 else _GatherFromSequence.apply(x, tp, dim, tag)


@torch.compiler.disable  # a collective: a compiled layer breaks here, it runs eagerly
def reduce_scatter_to_sequence(x: torch.Tensor, tp: RankGroup, dim: int = 1,
                               tag: str = "") -> torch.Tensor:
    """(B, T, C) partial sums -> (B, T / tp, C) reduced: reduce-scatter forward, all-gather
    backward (sequence parallelism's g)."""
    return x if tp.size == 1 else _ReduceScatterToSequence.apply(x, tp, dim, tag)


@torch.compiler.disable  # a collective: a compiled layer breaks here, it runs eagerly
def linear_reduce(x: torch.Tensor, weight: torch.Tensor, tp: RankGroup,
                  tag: str = "") -> torch.Tensor:
    """A row-parallel layer's ``F.linear(x, weight)`` (partial sums) followed by
    ``reduce_from_region`` (or, under sequence parallelism, ``reduce_scatter_to_sequence``),
    as one autograd step, for layers that selective recomputation runs twice
    (``parallel.activation_checkpoint``). (..., in / N) -> (..., out), or (B, T / N, out).

    The partial sums feed only the reduction, whose output the recomputation replays
    (``comm.replay``); as two steps, the selective checkpoint would keep them as a matmul's
    output (b s h elements, the whole sequence, per row-parallel layer: more than the
    reduced output it replays). Here the product is hidden from the checkpoint's op
    counters, computed in forward and skipped when recomputed; the backward takes the
    products autograd takes for the two steps, so gradients are bit for bit theirs."""
    return _LinearReduce.apply(x, weight, tp, tag)


def per_layer_table() -> list[dict]:
    """Rows ``{layer, phase, collective, calls, elements, bytes_sent}`` summed over
    ``layer_log`` (this rank). ``bytes_sent`` is None for "native" algorithms (the
    backend moves the bytes itself and ``comm.accounting`` cannot see them)."""
    rows: dict[tuple, dict] = {}
    for tag, phase, rec in layer_log:
        key = (tag, phase, rec.collective)
        row = rows.setdefault(key, {"layer": tag, "phase": phase, "collective": rec.collective,
                                    "calls": 0, "elements": 0, "bytes_sent": 0})
        row["calls"] += 1
        row["elements"] += rec.nbytes // max(1, _itemsize(rec.dtype))
        row["bytes_sent"] = (None if rec.bytes_sent is None or row["bytes_sent"] is None
                             else row["bytes_sent"] + rec.bytes_sent)
    return list(rows.values())


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size() if dtype != "-" else 1
