"""Shared-memory transport for the ranks of one host: reduce-scatter, all-gather, broadcast,
barrier, and all-reduce as reduce-scatter + all-gather.

The design of the intra-node paths of NCCL (SHM transport), oneCCL and DeepSpeed's CPU
``shm_comm``: every rank of the group maps one segment; a collective is a sequence of
*rounds*, and in each round every rank copies what its peers need into its own slot, raises
its sequence number in the segment, waits until every peer's number has reached the same
value, then reads its peers' slots. No message goes through the backend once the segment
exists; the only synchronisation is the sequence numbers.

Reduce-scatter of a flat buffer cut into N regions (``bounds``): each round carries one
piece of every region; rank r publishes the pieces of the regions i != r, and reduces
region r as ``((x_0 op x_1) op x_2) ...`` in group-rank order, in cache-sized chunks (so the
same bits on every rank and for every element, whoever reduces it). All-gather: rank r
publishes its region's piece, every rank copies the others'. Broadcast: the root publishes.
All-reduce fuses the two: the reduced piece goes from the cache straight to the buffer and
to the unused place of region r in rank r's slot (the same set: it holds inputs of regions
i != r only), then a second round and every rank copies the others' results; per rank this
moves about 4 X bytes through memory at N = 2 where reduce-scatter + all-gather move 4.5 X.

Bytes (accounting): ``bytes_sent`` are the bytes a rank copies into its slot for its peers,
``bytes_recv`` the bytes it reads from its peers' slots (its own contribution is read from
its private buffer and not counted); a message is one region piece, a step is one round.
All-reduce of X bytes on N ranks (N | numel): sent (N-1)/N X + X/N = X, received
2 (N-1)/N X, in 2 ceil(X / SLOT_BYTES) rounds (``rounds``).

The segment, its rounds, waiting and lifetime: ``shm_segment.py``."""

from __future__ import annotations

import torch

from shardwise.comm.primitives import Call, balanced_bounds, combine_into, finish_
from shardwise.comm.shm_segment import PREFIX, SLOT_BYTES, Segment, available, release, segment

__all__ = ["available", "segment", "release", "reduce_scatter", "all_gather", "all_reduce",
           "broadcast", "barrier", "rounds", "PREFIX", "SLOT_BYTES", "Segment"]


def _count(call: Call, step: int, nbytes: int, sent: bool) -> None:
    if call.record is not None and nbytes:
        call.record.add_message(step, nbytes, sent)


def _reduce(srcs: list[torch.Tensor], dst: torch.Tensor, op: str, tmp: torch.Tensor,
            direct: bool, div: int = 0, also: torch.Tensor | None = None) -> None:
    """dst <- ((srcs[0] op srcs[1]) op srcs[2]) ..., chunk by chunk. ``direct``: dst may be
    written before the last source is read (dst is none of srcs[2:]). ``div``: then divide
    by it; ``also``: copy each finished chunk there too, while it is in the cache."""
    numel, c = dst.numel(), tmp.numel()
    for a in range(0, numel, c):
        b = min(numel, a + c)
        acc = dst[a:b] if direct else tmp[:b - a]
        if len(srcs) == 1:
            acc.copy_(srcs[0][a:b])
        else:
            combine_into(srcs[0][a:b], srcs[1][a:b], acc, op)
        for s in srcs[2:]:
            combine_into(acc, s[a:b], acc, op)
        if div:
            acc.div_(div)
        if not direct:
            dst[a:b].copy_(acc)
        if also is not None:
            also[a:b].copy_(acc)


def _exchange_piece(seg: Segment, call: Call, buf: torch.Tensor, bounds: list[int],
                    cuts: list[list[int]], width: int, j: int, step: int):
    """Round ``step`` of a reduce-scatter, piece ``j``: copy piece ``j`` of every peer's region
    of ``buf`` into our slot (peer i's at offset ``i * width``), wait until every rank has
    done the same, and return ``(slots, our slot, a, b, own, srcs)``: piece ``j``'s bounds
    ``[a, b)`` inside our region, its view ``own`` in ``buf``, and its copies from every rank
    in group-rank order (``own`` at ours), the order every rank reduces in."""
    n, r, esz = seg.n, seg.rank, buf.element_size()
    slots = seg.slots(buf.dtype)
    mine = slots[r]
    for i in range(n):
        a, b = cuts[i][j], cuts[i][j + 1]
        if i != r and b > a:
            mine[i * width:i * width + b - a].copy_(buf[bounds[i] + a:bounds[i] + b])
            _count(call, step, (b - a) * esz, True)
    seg.round(call, step)
    a, b = cuts[r][j], cuts[r][j + 1]
    own = buf[bounds[r] + a:bounds[r] + b]
    srcs = [own if k == r else slots[k][r * width:r * width + b - a] for k in range(n)]
    return slots, mine, a, b, own, srcs


def reduce_scatter(seg: Segment, call: Call, buf: torch.Tensor, bounds: list[int], op: str,
                   finish_n: int | None = None, step0: int = 0) -> int:
    """Region r of ``buf`` (flat, ``bounds`` as ``ring.reduce_scatter``) on group rank r
    becomes the reduction of every rank's region r; other regions are left as they were.
    ``finish_n``: divide the result by it for "mean" (None: not here). Returns the last step."""
    n, r, esz = seg.n, seg.rank, buf.element_size()
    lens = [bounds[i + 1] - bounds[i] for i in range(n)]
    width = seg.slot // esz // n
    pieces = max(1, -(-max(lens) // width))
    cuts = [balanced_bounds(m, pieces) for m in lens]
    tmp = seg.tmp(buf.dtype)
    step = step0
    for j in range(pieces):
        step += 1
        _, _, a, b, own, srcs = _exchange_piece(seg, call, buf, bounds, cuts, width, j, step)
        if b > a:
            _reduce(srcs, own, op, tmp, direct=r < 2)
            for k in range(n):
                if k != r:
                    _count(call, step, (b - a) * esz, False)
    if finish_n is not None:
        finish_(buf[bounds[r]:bounds[r + 1]], op, finish_n)
    return step


def all_gather(seg: Segment, call: Call, buf: torch.Tensor, bounds: list[int],
               step0: int = 0) -> int:
    """Region r of ``buf`` valid on group rank r -> every region valid everywhere."""
    n, r, esz = seg.n, seg.rank, buf.element_size()
    lens = [bounds[i + 1] - bounds[i] for i in range(n)]
    width = seg.slot // esz
    pieces = max(1, -(-max(lens) // width))
    cuts = [balanced_bounds(m, pieces) for m in lens]
    step = step0
    for j in range(pieces):
        slots = seg.slots(buf.dtype)
        step += 1
        a, b = cuts[r][j], cuts[r][j + 1]
        if b > a:
            slots[r][:b - a].copy_(buf[bounds[r] + a:bounds[r] + b])
            _count(call, step, (b - a) * esz, True)
        seg.round(call, step)
        for k in range(n):
            a, b = cuts[k][j], cuts[k][j + 1]
            if k != r and b > a:
                buf[bounds[k] + a:bounds[k] + b].copy_(slots[k][:b - a])
                _count(call, step, (b - a) * esz, False)
    return step


def all_reduce(seg: Segment, call: Call, buf: torch.Tensor, op: str) -> int:
    """Fused reduce-scatter + all-gather over ``balanced_bounds(numel, N)`` (see the module
    docstring). Every element is reduced in group-rank order by one rank and copied: all
    ranks end bitwise identical. Returns the number of rounds."""
    n, r, esz = seg.n, seg.rank, buf.element_size()
    plan = seg.plans.get((buf.numel(), esz))
    if plan is None:
        bounds = balanced_bounds(buf.numel(), n)
        lens = [bounds[i + 1] - bounds[i] for i in range(n)]
        width = seg.slot // esz // n
        pieces = max(1, -(-max(lens) // width))
        plan = (bounds, width, pieces, [balanced_bounds(m, pieces) for m in lens])
        if len(seg.plans) < 256:
            seg.plans[buf.numel(), esz] = plan
    bounds, width, pieces, cuts = plan
    tmp = seg.tmp(buf.dtype)
    step = 0
    for j in range(pieces):
        step += 1
        slots, mine, a, b, own, srcs = _exchange_piece(seg, call, buf, bounds, cuts, width, j,
                                                       step)
        if b > a:
            res = mine[r * width:r * width + b - a]
            _reduce(srcs, res, op, tmp, direct=True, div=n if op == "mean" else 0, also=own)
            _count(call, step + 1, (b - a) * esz, True)
            for k in range(n):
                if k != r:
                    _count(call, step, (b - a) * esz, False)
        step += 1
        seg.round(call, step, keep=True)
        for k in range(n):
            a, b = cuts[k][j], cuts[k][j + 1]
            if k != r and b > a:
                buf[bounds[k] + a:bounds[k] + b].copy_(slots[k][k * width:k * width + b - a])
                _count(call, step, (b - a) * esz, False)
    return step


def broadcast(seg: Segment, call: Call, buf: torch.Tensor, root: int) -> int:
    """Copy ``buf`` of group rank ``root`` to every rank, piece by piece through its slot."""
    esz, width = buf.element_size(), seg.slot // buf.element_size()
    cut = balanced_bounds(buf.numel(), max(1, -(-buf.numel() // width)))
    step = 0
    for a, b in zip(cut[:-1], cut[1:]):
        slot = seg.slots(buf.dtype)[root]
        step += 1
        if seg.rank == root:
            slot[:b - a].copy_(buf[a:b])
            _count(call, step, (b - a) * esz, True)
        seg.round(call, step)
        if seg.rank != root:
            buf[a:b].copy_(slot[:b - a])
            _count(call, step, (b - a) * esz, False)
    return step


def barrier(seg: Segment, call: Call) -> int:
    """Barrier over the segment's ranks: one round with no payload. Returns the rounds used (1)."""
    seg.round(call, 1)
    return 1


def rounds(numel: int, esz: int, n: int, slot_bytes: int = SLOT_BYTES) -> int:
    """Rounds of an all-reduce of ``numel`` elements on N ranks (the cost model's count)."""
    return 2 * max(1, -(-(-(-numel // n)) // (slot_bytes // esz // n)))
