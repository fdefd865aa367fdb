"""Pipeline schedules as data: pure functions from (kind, p, m, v) to instruction lists.

A model is cut into ``p * v`` chunks; chunk ``c`` lives on pipeline rank ``c % p`` (so with
``v = 1`` chunk ``c`` is stage ``c``, and with ``v > 1`` each rank holds ``v`` chunks that
are ``p`` apart, as in the interleaved schedule). A schedule is one list of frozen
instructions per rank; one executor runs it, the checker validates it without processes and
the timeline draws it.

Kinds (``KINDS``):

- ``naive``: one micro-batch at a time through the whole pipeline, forward then backward;
  one rank busy at a time (plain model parallelism, seed 000).
- ``gpipe``: all ``m`` forwards, then all ``m`` backwards, one flush; bubble
  ``(p-1)/(m+p-1)`` and ``m`` micro-batches in flight (Huang et al. 2019, GPipe).
- ``1f1b``: PipeDream-Flush: rank ``r`` does ``p-r-1`` warm-up forwards, then alternates one
  forward and one backward, then drains; same bubble, at most ``p-r`` in flight
  (Narayanan et al. 2021, "Memory-efficient pipeline-parallel DNN training").
- ``interleaved``: 1F1B over ``v`` chunks per rank; warm-up ``2(p-r-1) + (v-1)p`` forwards,
  bubble ``(p-1)/(v m + p - 1)``; needs ``m % p == 0`` (Narayanan et al., SC 2021).
- ``pipedream``: the 1F1B order without a flush: each rank steps its optimizer after every
  backward, and the executor stashes the weights each forward used so that micro-batch's
  backward sees the same version (Narayanan et al. 2019, PipeDream, weight stashing).

Communication is derived, not hand-written: the compute order of every rank is timed on an
ideal machine with unit costs (``time_orders``, on ``time_lists``: the one schedule timer,
which the planner's step-time walk runs too), each cross-rank dependency becomes a send on
the producer and a receive on the consumer at the producer's finish time, and every rank's
list is sorted by that time. Since every rank then meets its transfers in one global order, the lists cannot
deadlock even when a send blocks until the matching receive is posted (``check`` verifies it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from shardwise.base.config import SCHEDULE_KINDS as KINDS  # one list, the config's too


class ScheduleError(ValueError):
    """A schedule cannot be built from these arguments, or a given one is invalid."""


@dataclass(frozen=True)
class Forward:
    """Run chunk ``chunk``'s forward on micro-batch ``mb`` (first chunk: embed the tokens;
    last chunk: also compute the loss)."""

    mb: int
    chunk: int


@dataclass(frozen=True)
class Backward:
    """Backward of chunk ``chunk`` on micro-batch ``mb``; gradients accumulate in ``.grad``."""

    mb: int
    chunk: int


@dataclass(frozen=True)
class SendActivation:
    """Send chunk ``chunk``'s output for ``mb`` to pipeline rank ``peer`` (chunk + 1)."""

    mb: int
    chunk: int
    peer: int


@dataclass(frozen=True)
class RecvActivation:
    """Receive the input of chunk ``chunk`` for ``mb`` from pipeline rank ``peer``."""

    mb: int
    chunk: int
    peer: int


@dataclass(frozen=True)
class SendGrad:
    """Send the gradient w.r.t. chunk ``chunk``'s input for ``mb`` to rank ``peer``."""

    mb: int
    chunk: int
    peer: int


@dataclass(frozen=True)
class RecvGrad:
    """Receive the gradient w.r.t. chunk ``chunk``'s output for ``mb`` from rank ``peer``."""

    mb: int
    chunk: int
    peer: int


@dataclass(frozen=True)
class OptimizerStep:
    """Step this rank's optimizer (after ``mb``'s backward for PipeDream; ``-1``: the flush)."""

    mb: int = -1


COMPUTE = (Forward, Backward)
COMM = (SendActivation, RecvActivation, SendGrad, RecvGrad)
Instruction = Forward | Backward | SendActivation | RecvActivation | SendGrad | RecvGrad | OptimizerStep


@dataclass(frozen=True)
class Schedule:
    """``ranks[r]`` is pipeline rank ``r``'s instruction list. ``weight_stashing``: the executor
    must keep, per micro-batch, the weights its forward used (PipeDream)."""

    kind: str
    p: int
    m: int
    v: int
    ranks: tuple[tuple[Instruction, ...], ...]
    weight_stashing: bool = False

    @property
    def n_chunks(self) -> int:
        """Model chunks in the pipeline: ``p * v``."""
        return self.p * self.v

    def chunks_of(self, rank: int) -> list[int]:
        """Global chunk ids held by pipeline rank ``rank``, in model order."""
        return [rank + i * self.p for i in range(self.v)]


def validate_args(kind: str, p: int, m: int, v: int = 1) -> None:
    """Raise ``ScheduleError`` (one line) for arguments no schedule of ``kind`` accepts."""
    if kind not in KINDS:
        raise ScheduleError(f"unknown schedule {kind!r}; expected one of {', '.join(KINDS)}")
    for name, val in (("p (pipeline stages)", p), ("m (micro-batches)", m), ("v (chunks per rank)", v)):
        if not isinstance(val, int) or val < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {val!r}")
    if v > 1 and kind != "interleaved":
        raise ScheduleError(f"v={v} chunks per rank needs the interleaved schedule, not {kind!r}")
    if kind == "interleaved" and v > 1 and m % p:
        raise ScheduleError(f"interleaved schedule needs micro-batches divisible by the stages: "
                            f"m={m} is not a multiple of p={p}")


def warmup_forwards(p: int, m: int, v: int, rank: int) -> int:
    """Forwards before the first backward on ``rank``: 1F1B ``min(p-rank-1, m)``; interleaved
    (v > 1) ``min(2(p-rank-1) + (v-1)p, m v)`` as in Narayanan et al., SC 2021 / Megatron."""
    if v == 1:
        return min(p - rank - 1, m)
    return min(2 * (p - rank - 1) + (v - 1) * p, m * v)


def compute_order(kind: str, p: int, m: int, v: int = 1) -> list[list[Forward | Backward]]:
    """Per rank, the order of its forwards and backwards (no communication yet)."""
    validate_args(kind, p, m, v)
    orders: list[list[Forward | Backward]] = []
    for r in range(p):
        if kind == "naive":
            order = [op for i in range(m) for op in (Forward(i, r), Backward(i, r))]
        elif kind == "gpipe":
            order = [Forward(i, r) for i in range(m)] + [Backward(i, r) for i in range(m)]
        else:  # 1f1b, pipedream, interleaved (1f1b is interleaved with v = 1)
            fwd = [_interleaved_unit(k, p, v, r, backward=False) for k in range(m * v)]
            bwd = [_interleaved_unit(k, p, v, r, backward=True) for k in range(m * v)]
            warm = warmup_forwards(p, m, v, r)
            order = list(fwd[:warm])
            for k in range(m * v - warm):
                order += [fwd[warm + k], bwd[k]]
            order += bwd[m * v - warm:]
        orders.append(order)
    return orders


def _interleaved_unit(k: int, p: int, v: int, rank: int, backward: bool) -> Forward | Backward:
    """The k-th forward (or backward) of ``rank``: micro-batches in groups of p per chunk."""
    mb = (k // (p * v)) * p + k % p
    local = (k // p) % v
    if backward:
        return Backward(mb, (v - 1 - local) * p + rank)
    return Forward(mb, local * p + rank)


def _deps(op: Forward | Backward, n_chunks: int) -> list[Forward | Backward]:
    """Compute results ``op`` needs: the previous chunk's forward, the next chunk's backward
    and, for a backward, its own forward."""
    if isinstance(op, Forward):
        return [Forward(op.mb, op.chunk - 1)] if op.chunk > 0 else []
    deps: list[Forward | Backward] = [Forward(op.mb, op.chunk)]
    if op.chunk < n_chunks - 1:
        deps.append(Backward(op.mb, op.chunk + 1))
    return deps


COMPUTE_STREAM, COMM_STREAM = 0, 1
"""The two streams of a rank: its compute (forwards, backwards) and its communication
thread (sends, one message at a time)."""

class Timing(NamedTuple):
    """What ``time_lists`` gives."""

    times: dict
    """``{instruction: (start, end)}`` of every timed instruction (and of ``done``'s)."""
    events: list
    """``(rank, instruction, start, end)`` of each timed instruction, in the order timed."""
    free: list
    """Per stream (``COMPUTE_STREAM``, ``COMM_STREAM``), per rank: the end of its last
    instruction (the ``start`` given where it ran none)."""


def time_lists(lists: Sequence[Sequence], price: Callable, done: dict | None = None,
               start: float = 0.0) -> Timing:
    """Time ``lists[r]``, rank ``r``'s instructions, run in order. ``price(r, ins)`` gives
    ``(stream, deps, seconds)``: ``ins`` starts at the latest of its stream's last end and
    its ``deps``' ends (instructions of any rank, or of ``done``) and lasts ``seconds`` (any
    time unit); ``None``: it takes no time and waits on nothing (a posted receive, an
    optimizer step). ``done``: ``{instruction: (start, end)}`` already run; nothing starts
    before ``start``. Ranks are visited in turn, each as far as its dependencies allow.
    Raises ``ScheduleError`` if the lists wait on each other forever."""
    p = len(lists)
    times: dict = dict(done or {})
    free = [[float(start)] * p, [float(start)] * p]
    events: list = []
    pc = [0] * p
    remaining = sum(len(x) for x in lists)
    while remaining:
        progressed = False
        for r in range(p):
            while pc[r] < len(lists[r]):
                ins = lists[r][pc[r]]
                priced = price(r, ins)
                if priced is not None:
                    stream, deps, seconds = priced
                    if any(d not in times for d in deps):
                        break
                    t0 = max([free[stream][r]] + [times[d][1] for d in deps])
                    t1 = t0 + seconds
                    times[ins] = (t0, t1)
                    free[stream][r] = t1
                    events.append((r, ins, t0, t1))
                pc[r], remaining, progressed = pc[r] + 1, remaining - 1, True
        if not progressed:
            stuck = {r: lists[r][pc[r]] for r in range(p) if pc[r] < len(lists[r])}
            raise ScheduleError(f"the lists wait on each other forever at {stuck}")
    return Timing(times, events, free)


def list_deps(r: int, ins, p: int, n_chunks: int) -> list:
    """What instruction ``ins`` of rank ``r`` in a schedule's lists (``Schedule.ranks``)
    waits on: a compute its input computed on this rank, or else the send that brings it
    (``SendActivation``/``SendGrad`` to ``r``); a send, the compute whose result it sends.
    Chunk ``c`` lives on rank ``c % p``."""
    if isinstance(ins, (SendActivation, SendGrad)):
        return [(Forward if isinstance(ins, SendActivation) else Backward)(ins.mb, ins.chunk)]
    deps = _deps(ins, n_chunks)
    out = [deps[0]] if isinstance(ins, Backward) else []
    for d in deps[len(out):]:
        if d.chunk % p == r:
            out.append(d)
        elif isinstance(d, Forward):
            out.append(SendActivation(d.mb, d.chunk, r))
        else:
            out.append(SendGrad(d.mb, d.chunk, r))
    return out


def time_orders(orders: Sequence[Sequence[Forward | Backward]], p: int, v: int = 1,
             forward_cost: Sequence[float] | float = 1.0,
             backward_cost: Sequence[float] | float | None = None,
             done: dict | None = None, not_before: float = 0.0) -> dict:
    """Run the per-rank compute orders on an ideal machine (no communication time), on the
    one schedule timer (``time_lists``).

    Costs are per chunk (a sequence of length ``p*v``) or one number for all, in any time
    unit; ``backward_cost`` defaults to twice the forward. ``done``: ``{op: (start, end)}``
    of operations already run (an earlier part of a stream); nothing starts before
    ``not_before``. Returns ``{op: (start, end)}`` of ``orders``' operations.
    Raises ``ScheduleError`` if the orders wait on each other forever.
    """
    n = p * v
    fc = [float(forward_cost)] * n if isinstance(forward_cost, (int, float)) else list(forward_cost)
    if backward_cost is None:
        bc = [2 * c for c in fc]
    elif isinstance(backward_cost, (int, float)):
        bc = [float(backward_cost)] * n
    else:
        bc = list(backward_cost)
    cost = {Forward: fc, Backward: bc}
    times = time_lists(
        orders, lambda r, op: (COMPUTE_STREAM, _deps(op, n), cost[type(op)][op.chunk]),
        done, not_before).times
    return {op: t for op, t in times.items() if done is None or op not in done}


def timed_events(orders, times, p: int, n_chunks: int, step_every_backward: bool):
    """Per rank, unsorted ``(time, priority, transfer id, instruction)``: each compute at its
    start, a send and its receive at the producer's finish time (both ends share the id),
    an optimizer step at the end of a backward (``step_every_backward``)."""
    events: list[list[tuple]] = [[] for _ in range(p)]
    for r, order in enumerate(orders):
        for op in order:
            events[r].append((times[op][0], 2, (), op))
            if step_every_backward and isinstance(op, Backward):
                events[r].append((times[op][1], 1, (), OptimizerStep(op.mb)))
    for op, (_, end) in times.items():
        src = op.chunk % p
        if isinstance(op, Forward) and op.chunk < n_chunks - 1:
            dst, key = (op.chunk + 1) % p, (0, op.mb, op.chunk)
            if dst != src:
                events[src].append((end, 0, key, SendActivation(op.mb, op.chunk, dst)))
                events[dst].append((end, 0, key, RecvActivation(op.mb, op.chunk + 1, src)))
        elif isinstance(op, Backward) and op.chunk > 0:
            dst, key = (op.chunk - 1) % p, (1, op.mb, op.chunk)
            if dst != src:
                events[src].append((end, 0, key, SendGrad(op.mb, op.chunk, dst)))
                events[dst].append((end, 0, key, RecvGrad(op.mb, op.chunk - 1, src)))
    return events


def _with_comm(orders, times, p: int, n_chunks: int, step_every_backward: bool):
    """Insert sends/receives at the producer's finish time; sort each rank by time.

    At equal times transfers come first, then an optimizer step, then the compute that
    starts then; transfers at equal times are ordered by a global id, the same on both ends.
    """
    out = []
    for ev in timed_events(orders, times, p, n_chunks, step_every_backward):
        ev.sort(key=lambda e: e[:3])  # time, then transfers, steps, computes; transfer id
        out.append(tuple(e[3] for e in ev))
    return out


def schedule(kind: str, p: int, m: int, v: int = 1) -> Schedule:
    """The instruction lists of ``kind`` for ``p`` pipeline ranks, ``m`` micro-batches and
    ``v`` chunks per rank. Raises ``ScheduleError`` with a one-line reason on bad input."""
    orders = compute_order(kind, p, m, v)
    times = time_orders(orders, p, v)
    pipedream = kind == "pipedream"
    ranks = _with_comm(orders, times, p, p * v, step_every_backward=pipedream)
    if not pipedream:
        ranks = [r + (OptimizerStep(),) for r in ranks]
    return Schedule(kind, p, m, v, tuple(tuple(r) for r in ranks), weight_stashing=pipedream)


def forward_only(p: int, v: int = 1) -> Schedule:
    """One micro-batch forward through the ``p * v`` chunks in order, with no backward and no
    optimizer step (evaluation and generation: ``Executor.forward``); its transfers are
    derived as ``schedule``'s."""
    n = p * v
    orders = [[Forward(0, c) for c in range(r, n, p)] for r in range(p)]
    ranks = _with_comm(orders, time_orders(orders, p, v), p, n, step_every_backward=False)
    return Schedule("forward", p, 1, v, tuple(tuple(r) for r in ranks))
