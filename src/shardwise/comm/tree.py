"""Binomial-tree broadcast and reduce, and the tree all-reduce (reduce, then broadcast).

Thakur, Rabenseifner & Gropp 2005, Sec. 4.1 (broadcast) and 4.3 (reduce). Ranks are
renumbered relative to the root, vr = (r - root) mod N. Broadcast: in step k (k = 1, 2, ...)
every rank vr < 2^(k-1) that already has the data sends it to vr + 2^(k-1); the last rank
receives in step ceil(log2 N). Reduce is the mirror image. Costs for X bytes:

    broadcast   ceil(log2 N) steps   ceil(log2 N) (alpha + X beta)
    reduce      ceil(log2 N) steps   ceil(log2 N) (alpha + X beta + X gamma)
    all-reduce  2 ceil(log2 N) steps, the root sends and receives ceil(log2 N) X bytes
"""

from __future__ import annotations

import torch

from shardwise.comm.primitives import Call, combine_, finish_, scratch


def broadcast(call: Call, buf: torch.Tensor, root: int, step0: int = 0) -> int:
    """Copy ``buf`` of group rank ``root`` to every rank, in place. Returns the last step."""
    n = call.size
    vr = (call.rank - root) % n
    mask, step = 1, step0
    while mask < n:
        step += 1
        if vr < mask and vr + mask < n:
            call.exchange(step, sends=[((vr + mask + root) % n, buf)])
        elif mask <= vr < 2 * mask:
            call.exchange(step, recvs=[((vr - mask + root) % n, buf)])
        mask *= 2
    return step


def reduce(call: Call, buf: torch.Tensor, root: int, op: str, step0: int = 0) -> int:
    """Reduce ``buf`` onto group rank ``root`` in place (mean divided there).

    On other ranks ``buf`` ends holding a partial reduction. Returns the last step.
    """
    n = call.size
    vr = (call.rank - root) % n
    mask, step = 1, step0
    tmp = None
    while mask < n:
        step += 1
        if vr & mask:  # lowest set bit: hand the partial result down and stop
            call.exchange(step, sends=[((vr - mask + root) % n, buf)])
            return step0 + _log2_ceil(n)
        if vr + mask < n:
            if tmp is None:
                tmp = scratch.get(buf.numel(), buf.dtype, buf.device)
            call.exchange(step, recvs=[((vr + mask + root) % n, tmp)])
            combine_(buf, tmp, op)
        mask *= 2
    finish_(buf, op, n)
    return step


def all_reduce(call: Call, buf: torch.Tensor, op: str) -> int:
    """Binomial reduce to group rank 0, then binomial broadcast from it."""
    step = reduce(call, buf, 0, op)
    return broadcast(call, buf, 0, step)


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length()
