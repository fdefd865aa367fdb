"""Recursive halving reduce-scatter, recursive doubling all-gather, and Rabenseifner's
all-reduce (the first followed by the second).

Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in
MPICH" (IJHPCA 19(1)), Sec. 4.4; the seeds' "Recursive Halving All Reduce". With p = N a
power of two, in step k of the halving phase rank v swaps half of its current range with
rank v XOR p/2^k and reduces the half it keeps; after log2 p steps it owns chunk v fully
reduced. The doubling phase retraces the steps, each time swapping the whole range owned so
far. All-reduce: 2 log2 p steps, 2 (p-1)/p X bytes sent per rank, cost
2 log2(p) alpha + 2 (p-1)/p X beta + (p-1)/p X gamma.

World sizes that are not a power of two (the standard fix-up of that paper): let p be the
largest power of two below N and rem = N - p. Among the first 2 rem ranks, each even rank
first hands its whole vector to the odd rank above it and sits out; the p remaining
"virtual" ranks run the power-of-two algorithm; at the end each odd rank hands the result
back. Two more steps and 2 X more bytes on those pairs: 2 log2(p) + 2 steps in all.
"""

from __future__ import annotations

import torch

from shardwise.comm.primitives import (
    Call,
    balanced_bounds,
    combine_,
    finish_,
    reduce_round,
    scratch,
)


class Fold:
    """The virtual-rank map of the non-power-of-two fix-up for a group of ``n`` ranks."""

    def __init__(self, n: int, rank: int) -> None:
        p = 1
        while p * 2 <= n:
            p *= 2
        self.p, self.rem, self.rank = p, n - p, rank
        if rank < 2 * self.rem:
            self.vrank = -1 if rank % 2 == 0 else rank // 2
        else:
            self.vrank = rank - self.rem
        self.log_p = p.bit_length() - 1

    def real(self, v: int) -> int:
        """The real rank of virtual rank ``v`` (of the ``p`` ranks that take part after the fold).
        """
        return 2 * v + 1 if v < self.rem else v + self.rem

    @property
    def folded(self) -> bool:
        """True on the ranks that take part in the fix-up steps."""
        return self.rank < 2 * self.rem

    def block_bounds(self, block: int) -> list[int]:
        """Element offsets of each virtual rank's blocks when real rank r owns block r."""
        return [block * (2 * v if v < self.rem else v + self.rem) for v in range(self.p)] + \
            [block * (self.p + self.rem)]


def halving(call: Call, buf: torch.Tensor, vb: list[int], fold: Fold, op: str,
            step: int) -> int:
    """Recursive halving among the virtual ranks: virtual rank v ends owning range v.

    A step returns once its receive is in; its send is waited for when the call closes
    (as ring's steps do: no wait for the peer to drain each send). That is safe: a range
    given away is never written again in the halving, and the doubling writes it only
    with data the peer computed from it, i.e. after receiving it. ``tmp`` is received into
    again only after it has been added. Each step's message is cut into pieces of
    ``settings.segment_bytes``, and piece i is added while i+1.. are still arriving.
    """
    v, lo, hi, mask = fold.vrank, 0, fold.p, fold.p // 2
    while mask:
        peer = fold.real(v ^ mask)
        mid = lo + mask
        keep, give = ((mid, hi), (lo, mid)) if v & mask else ((lo, mid), (mid, hi))
        step += 1  # the peer's keep is our give
        reduce_round(call, step, buf[vb[give[0]]:vb[give[1]]], peer, buf[vb[keep[0]]:vb[keep[1]]],
                     peer, op, defer_sends=True)
        lo, hi = keep
        mask //= 2
    return step


def doubling(call: Call, buf: torch.Tensor, vb: list[int], fold: Fold, step: int) -> int:
    """Recursive doubling among the virtual ranks: from range v valid to all ranges valid."""
    v, mask = fold.vrank, 1
    while mask < fold.p:
        peer = fold.real(v ^ mask)
        lo = (v // mask) * mask
        plo = lo ^ mask
        step += 1
        call.exchange(step, sends=[(peer, buf[vb[lo]:vb[lo + mask]])],
                      recvs=[(peer, buf[vb[plo]:vb[plo + mask]])], defer_sends=True)
        mask *= 2
    return step


def _fold_in(call: Call, buf: torch.Tensor, fold: Fold, op: str | None) -> None:
    """Step 1 of the fix-up: even rank 2i hands ``buf`` to rank 2i+1 (reduced if ``op``)."""
    r = fold.rank
    if r % 2 == 0:
        call.exchange(1, sends=[(r + 1, buf)])
    elif op is None:
        call.exchange(1, recvs=[(r - 1, buf)])
    else:
        tmp = scratch.get(buf.numel(), buf.dtype, buf.device)
        call.exchange(1, recvs=[(r - 1, tmp)])
        combine_(buf, tmp, op)


def all_reduce(call: Call, buf: torch.Tensor, op: str) -> int:
    """Rabenseifner's all-reduce of the flat ``buf`` in place. Returns the steps taken."""
    fold = Fold(call.size, call.rank)
    step = 0
    if fold.rem:
        step = 1
        if fold.folded:
            _fold_in(call, buf, fold, op)
    if fold.vrank >= 0:
        vb = balanced_bounds(buf.numel(), fold.p)
        step = halving(call, buf, vb, fold, op, step)
        finish_(buf[vb[fold.vrank]:vb[fold.vrank + 1]], op, call.size)
        step = doubling(call, buf, vb, fold, step)
    else:
        step += 2 * fold.log_p
    if fold.rem:
        step += 1
        if fold.folded:
            r = fold.rank
            if r % 2:
                call.exchange(step, sends=[(r - 1, buf)])
            else:
                call.exchange(step, recvs=[(r + 1, buf)])
    return step


def reduce_scatter(call: Call, buf: torch.Tensor, block: int, op: str) -> int:
    """Recursive halving reduce-scatter of ``buf`` (N blocks of ``block`` elements).

    On return block r of ``buf`` holds the reduced block r on group rank r; the rest of
    ``buf`` is scratch. Steps: log2 N (power of two), else log2 p + 2.
    """
    fold = Fold(call.size, call.rank)
    r, step = fold.rank, 0
    if fold.rem:
        step = 1
        if fold.folded:
            _fold_in(call, buf, fold, op)
    if fold.vrank >= 0:
        vb = fold.block_bounds(block)
        step = halving(call, buf, vb, fold, op, step)
        finish_(buf[vb[fold.vrank]:vb[fold.vrank + 1]], op, call.size)
    else:
        step += fold.log_p
    if fold.rem:
        step += 1
        if fold.folded:
            if r % 2:  # hand the even neighbour its block
                call.exchange(step, sends=[(r - 1, buf[(r - 1) * block:r * block])])
            else:
                call.exchange(step, recvs=[(r + 1, buf[r * block:(r + 1) * block])])
    return step


def all_gather(call: Call, buf: torch.Tensor, block: int) -> int:
    """Recursive doubling all-gather: block r of ``buf`` valid on rank r -> all valid.

    Steps: log2 N (power of two), else log2 p + 2.
    """
    fold = Fold(call.size, call.rank)
    r, step = fold.rank, 0
    if fold.rem:
        step = 1
        if fold.folded:
            if r % 2 == 0:
                call.exchange(1, sends=[(r + 1, buf[r * block:(r + 1) * block])])
            else:
                call.exchange(1, recvs=[(r - 1, buf[(r - 1) * block:r * block])])
    if fold.vrank >= 0:
        step = doubling(call, buf, fold.block_bounds(block), fold, step)
    else:
        step += fold.log_p
    if fold.rem:
        step += 1
        if fold.folded:
            e = r - 1 if r % 2 else r  # the even rank of the pair, whose block it already has
            head, tail = buf[:e * block], buf[(e + 1) * block:]
            if r % 2:
                call.exchange(step, sends=[(e, head), (e, tail)])
            else:
                call.exchange(step, recvs=[(r + 1, head), (r + 1, tail)])
    return step
