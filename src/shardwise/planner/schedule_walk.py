"""The schedule walk: a step's timeline from the pipeline schedule's instruction lists
(``pipeline.schedules.schedule(kind, p, m, v).ranks``, the lists the executor runs) and each
chunk's cost (``costs.ChunkCost``).

Each rank runs its list in order: a ``Forward``/``Backward`` starts when the rank is free
and its input (the previous chunk's activation, the next chunk's gradient) has arrived, and
lasts its compute time plus its communication; a ``Send*`` posts the tensor on the rank's
communication thread (one message at a time), to arrive ``p2p`` seconds later; a ``Recv*``
costs nothing (the executor posts receives without waiting; the compute that needs the
tensor waits). ``walk`` runs this on the pipeline's one timer
(``pipeline.schedules.time_lists``, which also times the schedules themselves); ``walk_fast``
solves the same longest path for 1F1B and interleaved with numpy (held equal to ``walk``);
``walk_shared`` is the processor-sharing variant for ranks that share cores, whose
durations depend on which ranks run at once, on the same dependencies
(``pipeline.schedules.list_deps``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from shardwise.parallel.pipeline.schedules import (
    COMM_STREAM,
    COMPUTE_STREAM,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    ScheduleError,
    SendActivation,
    SendGrad,
    list_deps,
    time_lists,
    warmup_forwards,
)
from shardwise.planner.costs import ChunkCost


def op_cost(f: ChunkCost, ins) -> tuple[float, float, float]:
    """(seconds, of which tp communication, of which waiting) of compute ``ins`` on a chunk
    costing ``f``. A split backward: B carries the backward's communication (the input
    gradient's all-reduces) and half its compute, W the other half (the weight gradient's
    matmuls equal the input gradient's)."""
    if isinstance(ins, Forward):
        return f.forward, f.tp_forward, f.wait_forward
    if isinstance(ins, Backward):
        return f.backward, f.tp_backward, f.wait_backward
    half = (f.backward - f.tp_backward) / 2
    if isinstance(ins, BackwardInput):
        return half + f.tp_backward, f.tp_backward, min(f.wait_backward, half + f.tp_backward)
    return half, 0.0, 0.0


class Walk(NamedTuple):
    """What a walk of the schedule gives per pipeline rank (``walk``, ``walk_fast``,
    ``walk_shared``)."""

    end: list[float]
    """Seconds from the step's start to the end of each rank's last compute."""
    busy: list[float]
    """Seconds each rank computes (its ops' time less their communication)."""
    tp: list[float]
    """Seconds each rank spends in communication inside its ops (``ChunkCost.tp_*``)."""
    events: list[dict]
    """The timeline: one dict per op (rank, kind, mb, chunk, start, end seconds); empty
    from ``walk_fast``."""


def walk(sched, costs: list[ChunkCost], p2p: float) -> Walk:
    """Time ``sched``'s instruction lists (a ``schedules.Schedule``) with ``costs[c]`` the
    seconds of chunk c's forward and backward and ``p2p`` the seconds of one send, on the
    pipeline's timer (``pipeline.schedules.time_lists``); returns per rank the end of its last
    compute, its busy compute seconds and its tp seconds, and the timeline events, as a
    ``Walk``. Raises ``ScheduleError`` if the lists deadlock."""
    p, n, place, split = sched.p, sched.n_chunks, sched.placement, sched.split_pairs
    computes = (Forward, Backward, BackwardInput, BackwardWeight)

    def price(r, ins):
        if isinstance(ins, computes):
            return (COMPUTE_STREAM, list_deps(r, ins, p, n, place, split),
                    op_cost(costs[ins.chunk], ins)[0])
        if isinstance(ins, (SendActivation, SendGrad)):
            return COMM_STREAM, list_deps(r, ins, p, n, place, split), p2p
        return None  # receives and the optimizer step: no time on either stream

    timing = time_lists(sched.ranks, price)
    busy, tp_time = [0.0] * p, [0.0] * p
    events = []
    for r, ins, start, end in timing.events:
        if isinstance(ins, (SendActivation, SendGrad)):
            continue
        seconds, tp, _ = op_cost(costs[ins.chunk], ins)
        busy[r] += seconds - tp
        tp_time[r] += tp
        events.append({"rank": r, "kind": type(ins).__name__, "mb": ins.mb,
                       "chunk": ins.chunk, "start": start, "end": end})
    return Walk(timing.free[COMPUTE_STREAM], busy, tp_time, events)


@lru_cache(maxsize=16)
def _orders(p: int, m: int, v: int):
    """The compute orders of ``schedules.compute_order("1f1b"/"interleaved", p, m, v)`` as
    arrays ``[rank, position]`` (``tests/test_planner_search.py`` holds them equal), with
    what ``walk_fast`` reads: per op its micro-batch, chunk, backward flag; the rank and
    position of the op its remote input comes from (the previous chunk's forward, the next
    chunk's backward: a send), the position of a backward's own forward, and per rank the
    positions of the ops that send (in order: a rank posts its sends one at a time)."""
    import numpy as np

    mv, n = m * v, p * v
    k = np.arange(mv)
    mb = (k // (p * v)) * p + k % p
    local = (k // p) % v
    bwd = np.zeros((p, 2 * mv), dtype=bool)
    O_mb = np.empty((p, 2 * mv), dtype=np.int64)
    O_c = np.empty((p, 2 * mv), dtype=np.int64)
    for r in range(p):
        w = warmup_forwards(p, m, v, r)
        b = np.concatenate([np.zeros(w, bool), np.tile([False, True], mv - w), np.ones(w, bool)])
        bwd[r] = b
        O_mb[r, ~b], O_c[r, ~b] = mb, local * p + r
        O_mb[r, b], O_c[r, b] = mb, (v - 1 - local) * p + r
    pos = np.empty((2, m, n), dtype=np.int64)
    pos[bwd.astype(np.int64), O_mb, O_c] = np.arange(2 * mv)[None, :]
    rem_c = np.where(bwd, O_c + 1, O_c - 1)
    has_rem = np.where(bwd, O_c < n - 1, O_c > 0)
    rem_k = pos[bwd.astype(np.int64), O_mb, np.clip(rem_c, 0, n - 1)]
    own_k = pos[0, O_mb, O_c]
    sends = np.where(bwd, O_c > 0, O_c < n - 1) if p > 1 else np.zeros_like(bwd)
    send_pos = [np.nonzero(sends[r])[0] for r in range(p)]
    return bwd, O_c, has_rem, rem_c % p, rem_k, own_k, send_pos


@lru_cache(maxsize=256)
def _walk_fast_memo(p: int, m: int, v: int, costs: tuple[ChunkCost, ...], p2p: float) -> Walk:
    """``walk_fast``, memoised by all it reads: a search simulates layouts that walk alike
    (ZeRO 0, 1 and 2 of one layout have the same chunk costs and transfers, and only their
    dp time after the walk differs). Its lists are shared: read them, never change them."""
    return walk_fast(p, m, v, list(costs), p2p)


def walk_fast(p: int, m: int, v: int, costs: list[ChunkCost], p2p: float) -> Walk:
    """``walk``'s ``Walk`` (end of each rank's last compute, busy compute seconds, tp
    seconds; no events) for the 1F1B and interleaved schedules, without walking instruction
    by instruction.

    The walk is a longest-path problem on a fixed graph: an op ends at max(its rank's
    previous op, its input) + its cost; a send arrives at max(the rank's previous send,
    its source op) + ``p2p``. Along one rank both are max-plus prefix scans (``end_k =
    C_k + max_{j<=k}(ready_j - C_{j-1})``, C the running cost), one numpy call each. The
    ranks are swept down and up (Gauss-Seidel), each scan reading its neighbours' latest
    arrivals, until nothing moves: every value only grows towards the longest path, which
    it reaches after as many sweeps as the critical path turns between going down and up
    the pipeline (3 to 7 here). Sums of busy time are taken in the walk's order (``cumsum``),
    so they are the walk's to the last bit; end times agree to rounding (1e-12)."""
    import numpy as np

    bwd, O_c, has_rem, rem_r, rem_k, own_k, send_pos = _orders(p, m, v)
    n = bwd.shape[1]
    cf = np.array([c.forward for c in costs])
    cb = np.array([c.backward for c in costs])
    cost = np.where(bwd, cb[O_c], cf[O_c])
    busy_v = np.where(bwd, np.array([c.backward - c.tp_backward for c in costs])[O_c],
                      np.array([c.forward - c.tp_forward for c in costs])[O_c])
    tp_v = np.where(bwd, np.array([c.tp_backward for c in costs])[O_c],
                    np.array([c.tp_forward for c in costs])[O_c])
    busy = np.cumsum(busy_v, axis=1)[:, -1].tolist()
    tp_time = np.cumsum(tp_v, axis=1)[:, -1].tolist()
    C = np.cumsum(cost, axis=1)
    Cp = C - cost
    sentinel = p * n  # a cell that stays 0: the input of an op that has none
    src = np.where(has_rem, rem_r * n + rem_k, sentinel)
    own = np.where(bwd, np.arange(p)[:, None] * n + own_k, sentinel)
    end = np.zeros(p * n + 1)
    arrival = np.zeros(p * n + 1)
    steps = [np.arange(len(s)) * p2p for s in send_pos]
    sends = [r * n + s for r, s in enumerate(send_pos)]
    order = list(range(p)) + list(range(p - 2, 0, -1)) if p > 2 else list(range(p))
    while True:
        before = end.copy()
        for r in order:
            ready = np.maximum(arrival[src[r]], end[own[r]])
            e = C[r] + np.maximum.accumulate(ready - Cp[r])
            end[r * n:(r + 1) * n] = e
            sp = send_pos[r]
            if len(sp):
                arrival[sends[r]] = steps[r] + p2p + np.maximum.accumulate(e[sp] - steps[r])
        if np.array_equal(before, end):
            break
    return Walk(end[n - 1:p * n:n].tolist(), busy, tp_time, [])


def walk_shared(sched, costs: list[ChunkCost], p2p: float, cores: int, replicas: int,
                contention: float = 1.0) -> Walk:
    """``walk`` for ranks that share ``cores`` cores (this machine): processor sharing. At
    every moment the ranks computing (times ``replicas``: the dp x cp x tp copies of each
    pipeline rank, running the same schedule at once) share the cores equally, so a rank
    idle in the bubble lends its core to the others; and each runs ``contention`` times
    slower than alone (``Cluster.contention``, measured where the world outnumbers the
    cores; in the bubble too, as the pipeline layouts measure: docs/planner.md). Costs
    are a dedicated core's."""
    p = sched.p
    lists, n_chunks = sched.ranks, sched.n_chunks
    pc, comm_free = [0] * p, [0.0] * p
    busy, tp_time, end_of = [0.0] * p, [0.0] * p, [0.0] * p
    running: dict[int, list] = {}  # rank -> [op, remaining work, start, tp share, wait]
    finished: dict = {}  # instruction -> when it ended (a send: when it arrived)
    events = []
    t = 0.0

    def ready_time(r, ins):
        """When ``ins``'s inputs are there (None: not yet known)."""
        deps = [finished.get(d) for d in list_deps(r, ins, p, n_chunks, sched.placement,
                                                   sched.split_pairs)]
        return None if None in deps else max(deps, default=0.0)

    def _advance(r, wake):
        while r not in running and pc[r] < len(lists[r]):
            ins = lists[r][pc[r]]
            if isinstance(ins, (SendActivation, SendGrad)):  # on the rank's link, in turn
                comm_free[r] = finished[ins] = max(comm_free[r], ready_time(r, ins)) + p2p
                pc[r] += 1
                continue
            if not isinstance(ins, (Forward, Backward, BackwardInput, BackwardWeight)):
                pc[r] += 1
                continue
            rt = ready_time(r, ins)
            if rt is None:
                break
            if rt > t + 1e-15:
                wake.append(rt)
                break
            work, tpw, wait = op_cost(costs[ins.chunk], ins)
            running[r] = [ins, work - wait, t, tpw / work if work else 0.0, wait]
            pc[r] += 1

    while True:
        moved = True
        while moved:  # a send found late in the pass can unblock an earlier rank
            moved = False
            wake = []
            for r in range(p):
                before = pc[r]
                _advance(r, wake)
                moved |= pc[r] != before
        computing = {r: v for r, v in running.items() if v[1] > 1e-12}
        waiting = {r: v for r, v in running.items() if v[1] <= 1e-12}
        if not running:
            if not wake:
                if all(pc[r] >= len(lists[r]) for r in range(p)):
                    break
                raise ScheduleError("schedule deadlocked in the simulator")
            t = min(wake)
            continue
        speed = min(1.0, cores / (max(1, len(computing)) * replicas)) / contention
        ends = [v[1] / speed for v in computing.values()] + [v[4] for v in waiting.values()]
        t_next = t + min(ends)
        if wake:
            t_next = min(t_next, min(wake))
        for r in list(running):
            ins, rem, start, tpf, wait = running[r]
            if rem > 1e-12:
                rem -= speed * (t_next - t)
                running[r][1] = rem
                continue
            wait -= t_next - t
            running[r][4] = wait
            if wait <= 1e-12:
                finished[ins] = t_next
                dur = t_next - start
                busy[r] += dur * (1 - tpf)
                tp_time[r] += dur * tpf
                end_of[r] = t_next
                events.append({"rank": r, "kind": type(ins).__name__, "mb": ins.mb,
                               "chunk": ins.chunk, "start": start, "end": t_next})
                del running[r]
        t = t_next
    return Walk(end_of, busy, tp_time, events)
