"""Ring algorithms: reduce-scatter, all-gather, and all-reduce as the two back to back.

Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations" (JPDC 69(2)); the seeds' "Ring All-Reduce": ranks form a ring, in every step
each rank sends one chunk to its right neighbour and receives one from its left.

For a buffer of X bytes cut into N chunks (``primitives.balanced_bounds``: sizes differ by
at most one element), with alpha the per-message latency, beta the seconds per byte and
gamma the seconds per reduced byte (Thakur et al. 2005, Sec. 4):

    reduce-scatter  N-1 steps   (N-1)/N X sent per rank   (N-1) alpha + (N-1)/N X (beta+gamma)
    all-gather      N-1 steps   (N-1)/N X sent per rank   (N-1) alpha + (N-1)/N X beta
    all-reduce    2(N-1) steps 2(N-1)/N X sent per rank

Exactly so when the element count divides by N. Otherwise rank r sends every chunk but
chunk r+1 (reduce-scatter) and every chunk but chunk r+2 (all-gather, indices mod N), so it
sends 2X minus those two chunks: within 2 elements of 2(N-1)/N X, and the ranks together
send exactly 2(N-1) X.
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
    settings,
)


def reduce_scatter(call: Call, buf: torch.Tensor, bounds: list[int], op: str,
                   step0: int = 0, finish: bool = True) -> int:
    """Reduce ``buf`` (flat) so that group rank r ends with the full chunk r, in place.

    Chunk i is ``buf[bounds[i]:bounds[i+1]]``. Other chunks are left partially reduced.
    ``finish`` applies the mean division to the owned chunk. Returns the last step used.
    """
    n, r = call.size, call.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        si, ri = (r - s - 1) % n, (r - s - 2) % n  # the sender's chunk si is our chunk ri
        reduce_round(call, step0 + s + 1, buf[bounds[si]:bounds[si + 1]], right,
                     buf[bounds[ri]:bounds[ri + 1]], left, op)
    if finish:
        finish_(buf[bounds[r]:bounds[r + 1]], op, n)
    return step0 + n - 1


def all_gather(call: Call, buf: torch.Tensor, bounds: list[int], step0: int = 0) -> int:
    """Given chunk r valid on group rank r, make every chunk valid everywhere, in place."""
    n, r = call.size, call.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        si, ri = (r - s) % n, (r - s - 1) % n
        call.exchange(step0 + s + 1, sends=[(right, buf[bounds[si]:bounds[si + 1]])],
                      recvs=[(left, buf[bounds[ri]:bounds[ri + 1]])])
    return step0 + n - 1


def all_reduce(call: Call, buf: torch.Tensor, op: str) -> int:
    """Ring all-reduce of the flat ``buf`` in place: reduce-scatter, then all-gather,
    pipelined over segments. Returns the number of steps, 2(N-1).

    Each chunk is cut into S pieces (S = ceil(widest chunk / ``segment_bytes``), the same
    cut on every rank), and piece j runs its own 2(N-1)-step ring: as soon as piece j of a
    step has arrived (and, in the reduce-scatter half, been added), piece j of the next step
    is posted, while pieces j+1.. of the earlier step are still in flight. So the all-gather
    starts before the reduce-scatter ends and the additions hide under transfers; with
    S = 1 it is the textbook two-phase ring. Bytes and steps are those of the plain ring;
    every step counts S messages.

    Every message between two ranks has the same tag and both sides post them in the same
    order (step-major, piece-minor), so they match. A received piece is written only
    after the same region's earlier send has been received downstream (causality of the
    ring), so no region is overwritten while it is being sent. Every chunk is reduced by
    exactly one rank and then copied: all ranks end bitwise identical.
    """
    n, r = call.size, call.rank
    bounds = balanced_bounds(buf.numel(), n)
    widest = max(bounds[i + 1] - bounds[i] for i in range(n))
    seg = settings.segment_bytes // buf.element_size()
    pieces = 1 if seg <= 0 or widest <= seg else -(-widest // seg)
    cuts = [balanced_bounds(bounds[i + 1] - bounds[i], pieces) for i in range(n)]
    width = -(-widest // pieces)
    tmp = scratch.get(width * pieces, buf.dtype, buf.device)
    last = 2 * (n - 1)

    def piece(chunk: int, j: int) -> torch.Tensor:
        c = cuts[chunk]
        return buf[bounds[chunk] + c[j]:bounds[chunk] + c[j + 1]]

    def sent(s: int) -> int:  # the chunk sent in step s (0-based) of the schedule
        return (r - s - 1) % n if s < n - 1 else (r - (s - n + 1)) % n

    def landing(s: int, j: int) -> torch.Tensor:  # where piece j of step s is received
        c = (r - s - 2) % n if s < n - 1 else (r - (s - n + 1) - 1) % n
        p = piece(c, j)
        return tmp[j * width:j * width + p.numel()] if s < n - 1 else p

    right, left = (r + 1) % n, (r - 1) % n
    recvs = [call.irecv(1, left, landing(0, j)) for j in range(pieces)]
    sends = [call.isend(1, right, piece(sent(0), j)) for j in range(pieces)]
    for s in range(last):
        for j in range(pieces):
            call.wait(recvs[j])
            if s < n - 1:
                mine = piece((r - s - 2) % n, j)
                combine_(mine, tmp[j * width:j * width + mine.numel()], op)
                if s == n - 2:
                    finish_(mine, op, n)
            if s + 1 < last:
                recvs[j] = call.irecv(s + 2, left, landing(s + 1, j))
                sends.append(call.isend(s + 2, right, piece(sent(s + 1), j)))
    for p in sends:
        call.wait(p)
    return last
