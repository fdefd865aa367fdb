"""Pipeline schedules as data: pure functions from (kind, p, m, v) to instruction lists.

A model is cut into ``p * v`` chunks; chunk ``c`` lives on pipeline rank ``c % p`` (so with
``v = 1`` chunk ``c`` is stage ``c``, and with ``v > 1`` each rank holds ``v`` chunks that
are ``p`` apart, as in the interleaved schedule), unless the schedule carries its own
``placement`` (ZB-V's V: chunk ``c`` on rank ``c`` for ``c < p``, on ``2p - 1 - c`` after).
A schedule is one list of frozen instructions per rank; one executor runs it, the checker
validates it without processes and the timeline draws it.

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
- ``zb1p``: ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241):
  each backward split into ``BackwardInput`` (B, the input gradient the previous stage waits
  for) and ``BackwardWeight`` (W, the weight gradient, which can wait); 1F1B's peak memory
  (at most ``p`` micro-batches held on any rank, from F to W), the W's filling the bubbles:
  the paper's handcrafted order (``_zb_h1_orders``), bubble ``(p-1)/(3m+p-1)`` for m >= p.
- ``zbv``: ZB-V (same paper): two chunks per rank in a V (``placement``), B/W split, at most
  ``2p`` chunk activations held per rank (1F1B's peak on rank 0); bubble near zero.
- ``dualpipev``: DualPipeV, the V-shaped ("cut-in-half") DualPipe of DeepSeek-V3
  (arXiv:2412.19437, section 3.2; github.com/deepseek-ai/DualPipe), in the order torch's
  ``ScheduleDualPipeV`` gives: ZB-V's V, a steady state that pairs one micro-batch's forward
  of one chunk with another's backward of the other chunk, fused backwards (``Backward``)
  where nothing waits for a W and split ones (B, then W) where the W's fill the warm-up and
  the drain; needs ``m >= 2p`` (``_dualpipev_orders``). On a GPU each pair overlaps its
  compute with the other's communication (and, for MoE, the all-to-alls); here the pair runs
  in turn, its transfers already overlapped by the executor's communication thread.

ZB-V's order is built greedily on unit costs (F = B = W = 1): each rank, when free, runs a
ready B (oldest micro-batch first), else a ready F if it holds fewer activations than its
limit, else its oldest pending W (``_zero_bubble_orders``).

Communication is derived, not hand-written: the compute order of every rank is timed on an
ideal machine with unit costs (``time_orders``, on ``time_lists``: the one schedule timer,
which the planner's step-time walk runs too), each cross-rank dependency becomes a send on
the producer and a receive on the consumer at the producer's finish time, and every rank's
list is sorted by that time. Since every rank then meets its transfers in one global order, the lists cannot
deadlock even when a send blocks until the matching receive is posted (``check`` verifies it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Callable, NamedTuple, Sequence

from shardwise.base.config import SCHEDULE_KINDS as KINDS  # one list, the config's too
from shardwise.base.config import (
    SPLIT_BACKWARD_KINDS,
    V_SHAPED_KINDS,
    chunks_refusal,
    micro_batches_refusal,
)


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
class BackwardInput:
    """B of a split backward: the gradient w.r.t. chunk ``chunk``'s input only on ``mb``
    (sent on at once); the graph is kept for its ``BackwardWeight``."""

    mb: int
    chunk: int


@dataclass(frozen=True)
class BackwardWeight:
    """W of a split backward: the gradients w.r.t. chunk ``chunk``'s parameters on ``mb``,
    accumulated in ``.grad`` as ``Backward`` does; frees what the B kept."""

    mb: int
    chunk: int


BACKWARDS = (Backward, BackwardInput)  # what produces a chunk's input gradient


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


COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
COMM = (SendActivation, RecvActivation, SendGrad, RecvGrad)
Instruction = (Forward | Backward | BackwardInput | BackwardWeight | SendActivation
               | RecvActivation | SendGrad | RecvGrad | OptimizerStep)
Compute = Forward | Backward | BackwardInput | BackwardWeight


@dataclass(frozen=True)
class Schedule:
    """``ranks[r]`` is pipeline rank ``r``'s instruction list. ``weight_stashing``: the executor
    must keep, per micro-batch, the weights its forward used (PipeDream). ``placement[c]``:
    the rank of chunk ``c`` (empty: ``c % p``). ``split``: backwards may be split into
    ``BackwardInput`` and ``BackwardWeight`` (zero-bubble schedules; a pair's backward is
    then split or fused, ``split_pairs``); else every backward is a fused ``Backward``."""

    kind: str
    p: int
    m: int
    v: int
    ranks: tuple[tuple[Instruction, ...], ...]
    weight_stashing: bool = False
    placement: tuple[int, ...] = ()
    split: bool = False

    @property
    def n_chunks(self) -> int:
        """Model chunks in the pipeline: ``p * v``."""
        return self.p * self.v

    def chunks_of(self, rank: int) -> list[int]:
        """Global chunk ids held by pipeline rank ``rank``, in model order."""
        return [c for c in range(self.n_chunks) if self.rank_of(c) == rank]

    def rank_of(self, chunk: int) -> int:
        """The pipeline rank that holds chunk ``chunk``."""
        return self.placement[chunk] if self.placement else chunk % self.p

    @cached_property
    def split_pairs(self) -> frozenset[tuple[int, int]]:
        """The ``(mb, chunk)`` pairs whose backward is split (a ``BackwardInput`` in the
        lists): what ``list_deps`` takes as ``split``."""
        return frozenset((op.mb, op.chunk) for ops in self.ranks for op in ops
                         if isinstance(op, BackwardInput))


def placement_of(kind: str, p: int, v: int) -> tuple[int, ...]:
    """The rank of each chunk: ZB-V's V (chunk ``c`` on rank ``c`` for ``c < p``, on
    ``2p - 1 - c`` after); ``c % p`` otherwise."""
    if kind in V_SHAPED_KINDS:
        return tuple(c if c < p else 2 * p - 1 - c for c in range(2 * p))
    return tuple(c % p for c in range(p * v))


def validate_args(kind: str, p: int, m: int, v: int = 1) -> None:
    """Raise ``ScheduleError`` (one line) for arguments no schedule of ``kind`` accepts."""
    if kind not in KINDS:
        raise ScheduleError(f"unknown schedule {kind!r}; expected one of {', '.join(KINDS)}")
    for name, val in (("p (pipeline stages)", p), ("m (micro-batches)", m), ("v (chunks per rank)", v)):
        if not isinstance(val, int) or val < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {val!r}")
    why = chunks_refusal(kind, v) or micro_batches_refusal(kind, p, m, v)
    if why:
        raise ScheduleError(why)


def warmup_forwards(p: int, m: int, v: int, rank: int) -> int:
    """Forwards before the first backward on ``rank``: 1F1B ``min(p-rank-1, m)``; interleaved
    (v > 1) ``min(2(p-rank-1) + (v-1)p, m v)`` as in Narayanan et al., SC 2021 / Megatron."""
    if v == 1:
        return min(p - rank - 1, m)
    return min(2 * (p - rank - 1) + (v - 1) * p, m * v)


def compute_order(kind: str, p: int, m: int, v: int = 1) -> list[list[Compute]]:
    """Per rank, the order of its forwards and backwards (no communication yet)."""
    validate_args(kind, p, m, v)
    if kind == "dualpipev":
        return _dualpipev_orders(p, m)
    if kind == "zb1p":
        return _zb_h1_orders(p, m)
    if kind == "zbv":
        place = placement_of(kind, p, v)
        return _zero_bubble_orders(p, m, place, [p * v] * p)  # 1F1B's peak, in chunks
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


def _zb_h1_orders(p: int, m: int) -> list[list[Compute]]:
    """ZB-H1's order (Qi et al. 2023, section 2.1): 1F1B's, each backward split, and each W
    deferred until the rank holds ``p`` micro-batches (F run, W not yet), 1F1B's peak on
    rank 0: rank ``r`` runs its ``p - r - 1`` warm-up forwards, then F and B in turn (a W
    after the B once ``p`` are held), then B and W in turn, then the deferred W's: the B's
    chain back at one unit a stage and the W's fill the cool-down, a third of 1F1B's bubble
    on equal costs."""
    orders: list[list[Compute]] = []
    for r in range(p):
        warm = min(p - r - 1, m)
        order: list[Compute] = [Forward(i, r) for i in range(warm)]
        f = held = warm
        b = w = 0
        while f < m:  # steady state
            order += [Forward(f, r), BackwardInput(b, r)]
            f, b, held = f + 1, b + 1, held + 1
            if held >= p:
                order.append(BackwardWeight(w, r))
                w, held = w + 1, held - 1
        while b < m:  # cool-down
            order += [BackwardInput(b, r), BackwardWeight(w, r)]
            b, w = b + 1, w + 1
        orders.append(order + [BackwardWeight(i, r) for i in range(w, m)])
    return orders


def _zero_bubble_orders(p: int, m: int, place: Sequence[int], limit: Sequence[int]
                        ) -> list[list[Compute]]:
    """Greedy list scheduling on unit costs (see the module docstring): at each time step
    each free rank runs a ready B (oldest micro-batch, later chunk first), else a ready F
    (same order) while it holds fewer than ``limit[r]`` activations (F run, W not yet),
    else its oldest pending W. Raises ``ScheduleError`` if no rank can ever move."""
    n = len(place)
    mine = [[c for c in range(n) if place[c] == r] for r in range(p)]
    end: dict = {}
    orders: list[list[Compute]] = [[] for _ in range(p)]
    pending_w: list[list[BackwardWeight]] = [[] for _ in range(p)]
    live, free, left = [0] * p, [0] * p, 3 * m * n
    key = lambda op: (op.mb, -op.chunk)  # noqa: E731 - oldest micro-batch, later chunk
    todo_f = [sorted((Forward(i, c) for c in mine[r] for i in range(m)), key=key)
              for r in range(p)]
    todo_b = [sorted((BackwardInput(i, c) for c in mine[r] for i in range(m)), key=key)
              for r in range(p)]
    t = 0
    while left:
        moved = False
        for r in range(p):
            if free[r] > t:
                continue
            ready = lambda op: all(end.get(d, t + 1) <= t for d in _deps(op, n, True))  # noqa
            op = next((b for b in todo_b[r] if ready(b)), None)
            if op is not None:
                todo_b[r].remove(op)
                pending_w[r].append(BackwardWeight(op.mb, op.chunk))
            elif live[r] < limit[r] and (op := next((f for f in todo_f[r] if ready(f)), None)):
                todo_f[r].remove(op)
                live[r] += 1
            elif pending_w[r]:
                op = pending_w[r].pop(0)
                live[r] -= 1
            else:
                continue
            orders[r].append(op)
            end[op], free[r], left, moved = t + 1, t + 1, left - 1, True
        if not moved:  # unit costs: all that ran has ended, so nothing ever will
            raise ScheduleError(f"zero-bubble orders stuck at p={p}, m={m}, time {t}")
        t += 1
    return orders


def _dualpipev_orders(p: int, m: int) -> list[list[Compute]]:
    """DualPipeV's compute order per rank (see the module docstring): rank ``r`` holds chunk
    ``r`` (phase 0, going down the V) and ``2p - 1 - r`` (phase 1, coming back). Its eight
    steps, as DualPipe's ``dualpipev.py`` and torch's ``ScheduleDualPipeV`` run them: F0 x
    2(p-r-1); (F0 F1) x (r+1); (B1 W F1) x (p-r-1); (F0 Bfused1 F1 Bfused0) x (m-2p+r+1);
    (Bfused1 F1 Bfused0) x (p-r-1); (B1 B0) x (r+1), fused until the middle one and split
    after; (W B0) x (p-r-1); W x (r+1). Each W is the oldest one owed."""
    orders: list[list[Compute]] = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        order: list[Compute] = []
        count: dict = {}  # (forward or backward, chunk) -> its next micro-batch
        owed: list[BackwardWeight] = []

        def run(kind, chunk: int) -> None:
            key = (kind is Forward, chunk)
            mb = count[key] = count.get(key, -1) + 1
            order.append(kind(mb, chunk))
            if kind is BackwardInput:
                owed.append(BackwardWeight(mb, chunk))

        def weight() -> None:
            if owed:
                order.append(owed.pop(0))

        for _ in range(2 * (p - r - 1)):
            run(Forward, c0)
        for _ in range(r + 1):
            run(Forward, c0), run(Forward, c1)
        for _ in range(p - r - 1):
            run(BackwardInput, c1), weight(), run(Forward, c1)
        for _ in range(m - 2 * p + r + 1):  # the steady state: F of one, B of the other
            run(Forward, c0), run(Backward, c1), run(Forward, c1), run(Backward, c0)
        for _ in range(p - r - 1):
            run(Backward, c1), run(Forward, c1), run(Backward, c0)
        split = False  # the drain's second half splits its backwards
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            run(BackwardInput if split else Backward, c1)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            run(BackwardInput if split else Backward, c0)
        for _ in range(p - r - 1):
            weight(), run(BackwardInput, c0)
        for _ in range(r + 1):
            weight()
        orders.append(order)
    return orders


def _grad_op(mb: int, chunk: int, split) -> Backward | BackwardInput:
    """What computes the gradient of chunk ``chunk``'s input on ``mb``: its ``BackwardInput``
    if ``split`` (a bool for every pair, or the set of split ``(mb, chunk)`` pairs) says so,
    else its ``Backward``."""
    is_split = split if isinstance(split, bool) else (mb, chunk) in split
    return (BackwardInput if is_split else Backward)(mb, chunk)


def _deps(op: Compute, n_chunks: int, split=False) -> list[Compute]:
    """Compute results ``op`` needs: the previous chunk's forward, the next chunk's backward
    (``_grad_op``: its ``BackwardInput`` where ``split``) and, for a backward, its own
    forward; a ``BackwardWeight`` its own ``BackwardInput``."""
    if isinstance(op, Forward):
        return [Forward(op.mb, op.chunk - 1)] if op.chunk > 0 else []
    if isinstance(op, BackwardWeight):
        return [BackwardInput(op.mb, op.chunk)]
    deps: list[Compute] = [Forward(op.mb, op.chunk)]
    if op.chunk < n_chunks - 1:
        deps.append(_grad_op(op.mb, op.chunk + 1, split))
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


def list_deps(r: int, ins, p: int, n_chunks: int, placement: Sequence[int] = (),
              split=False) -> list:
    """What instruction ``ins`` of rank ``r`` in a schedule's lists (``Schedule.ranks``)
    waits on: a compute its input computed on this rank, or else the send that brings it
    (``SendActivation``/``SendGrad`` to ``r``); a send, the compute whose result it sends.
    Chunk ``c`` lives on rank ``placement[c]`` (empty: ``c % p``); ``split``: the split
    backwards (``Schedule.split_pairs``, or a bool for all or none)."""
    if isinstance(ins, SendActivation):
        return [Forward(ins.mb, ins.chunk)]
    if isinstance(ins, SendGrad):
        return [_grad_op(ins.mb, ins.chunk, split)]
    deps = _deps(ins, n_chunks, split)
    out = [deps[0]] if not isinstance(ins, Forward) else []
    for d in deps[len(out):]:
        if (placement[d.chunk] if placement else d.chunk % p) == r:
            out.append(d)
        elif isinstance(d, Forward):
            out.append(SendActivation(d.mb, d.chunk, r))
        else:
            out.append(SendGrad(d.mb, d.chunk, r))
    return out


def time_orders(orders: Sequence[Sequence[Compute]], p: int, v: int = 1,
             forward_cost: Sequence[float] | float = 1.0,
             backward_cost: Sequence[float] | float | None = None,
             done: dict | None = None, not_before: float = 0.0) -> dict:
    """Run the per-rank compute orders on an ideal machine (no communication time), on the
    one schedule timer (``time_lists``).

    Costs are per chunk (a sequence of length ``p*v``) or one number for all, in any time
    unit; ``backward_cost`` defaults to twice the forward; a split backward's
    ``BackwardInput`` and ``BackwardWeight`` take half of it each. ``done``: ``{op: (start, end)}``
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
    half = [c / 2 for c in bc]
    cost = {Forward: fc, Backward: bc, BackwardInput: half, BackwardWeight: half}
    split = {(op.mb, op.chunk) for order in orders for op in order
             if isinstance(op, BackwardInput)}
    times = time_lists(
        orders, lambda r, op: (COMPUTE_STREAM, _deps(op, n, split), cost[type(op)][op.chunk]),
        done, not_before).times
    return {op: t for op, t in times.items() if done is None or op not in done}


def timed_events(orders, times, p: int, n_chunks: int, step_every_backward: bool,
                 placement: Sequence[int] = ()):
    """Per rank, unsorted ``(time, priority, transfer id, instruction)``: each compute at its
    start, a send and its receive at the producer's finish time (both ends share the id),
    an optimizer step at the end of a backward (``step_every_backward``). Chunk ``c`` on
    rank ``placement[c]`` (empty: ``c % p``)."""
    place = placement or tuple(c % p for c in range(n_chunks))
    events: list[list[tuple]] = [[] for _ in range(p)]
    for r, order in enumerate(orders):
        for op in order:
            events[r].append((times[op][0], 2, (), op))
            if step_every_backward and isinstance(op, Backward):
                events[r].append((times[op][1], 1, (), OptimizerStep(op.mb)))
    for op, (_, end) in times.items():
        if isinstance(op, BackwardWeight):
            continue
        src = place[op.chunk]
        if isinstance(op, Forward) and op.chunk < n_chunks - 1:
            dst, key = place[op.chunk + 1], (0, op.mb, op.chunk)
            if dst != src:
                events[src].append((end, 0, key, SendActivation(op.mb, op.chunk, dst)))
                events[dst].append((end, 0, key, RecvActivation(op.mb, op.chunk + 1, src)))
        elif isinstance(op, BACKWARDS) and op.chunk > 0:
            dst, key = place[op.chunk - 1], (1, op.mb, op.chunk)
            if dst != src:
                events[src].append((end, 0, key, SendGrad(op.mb, op.chunk, dst)))
                events[dst].append((end, 0, key, RecvGrad(op.mb, op.chunk - 1, src)))
    return events


def _with_comm(orders, times, p: int, n_chunks: int, step_every_backward: bool,
               placement: Sequence[int] = ()):
    """Insert sends/receives at the producer's finish time; sort each rank by time.

    At equal times transfers come first, then an optimizer step, then the compute that
    starts then; transfers at equal times are ordered by a global id, the same on both ends.
    """
    out = []
    for ev in timed_events(orders, times, p, n_chunks, step_every_backward, placement):
        ev.sort(key=lambda e: e[:3])  # time, then transfers, steps, computes; transfer id
        out.append(tuple(e[3] for e in ev))
    return out


@lru_cache(maxsize=128)  # immutable, and the zero-bubble orders take a while at large p
def schedule(kind: str, p: int, m: int, v: int = 1) -> Schedule:
    """The instruction lists of ``kind`` for ``p`` pipeline ranks, ``m`` micro-batches and
    ``v`` chunks per rank. Raises ``ScheduleError`` with a one-line reason on bad input."""
    orders = compute_order(kind, p, m, v)
    times = time_orders(orders, p, v)
    pipedream = kind == "pipedream"
    place = placement_of(kind, p, v) if kind in V_SHAPED_KINDS else ()
    ranks = _with_comm(orders, times, p, p * v, step_every_backward=pipedream, placement=place)
    if not pipedream:
        ranks = [r + (OptimizerStep(),) for r in ranks]
    return Schedule(kind, p, m, v, tuple(tuple(r) for r in ranks), weight_stashing=pipedream,
                    placement=place, split=kind in SPLIT_BACKWARD_KINDS)


def forward_only(p: int, v: int = 1, placement: Sequence[int] = ()) -> Schedule:
    """One micro-batch forward through the ``p * v`` chunks in order, with no backward and no
    optimizer step (evaluation and generation: ``Executor.forward``); its transfers are
    derived as ``schedule``'s. ``placement``: as ``Schedule.placement``."""
    n = p * v
    place = tuple(placement) or tuple(c % p for c in range(n))
    orders = [[Forward(0, c) for c in range(n) if place[c] == r] for r in range(p)]
    ranks = _with_comm(orders, time_orders(orders, p, v), p, n, step_every_backward=False,
                       placement=tuple(placement))
    return Schedule("forward", p, 1, v, tuple(tuple(r) for r in ranks),
                    placement=tuple(placement))
