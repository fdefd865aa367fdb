"""PipeDream without flushes: one endless 1F1B stream, cut into one segment per training step.

PipeDream (Narayanan et al. 2019, SOSP, sections 3.2-3.3) never drains the pipeline: after
the start-up phase every stage alternates one forward of a new micro-batch and one backward
of an old one, and updates its weights after every backward, so rank ``r`` always has
``p - r - 1`` micro-batches in flight. A trainer, though, hands the pipeline one batch of
``m`` micro-batches per call. ``stream(p, m)`` therefore cuts the rank's infinite 1F1B order
into segments: segment ``k`` runs from the forward of micro-batch ``k m`` (the first of step
``k``) up to, not including, the forward of ``(k+1) m``. Micro-batch ids are global
(``k m + i``), so a segment contains backwards of earlier steps' micro-batches, and leaves
some of its own in flight for the next. ``drain(k)`` is what follows segment ``k`` in a
stream that ends there: the backwards still pending (run before a checkpoint and at the end
of training, so that every gradient reaches the weights).

Between two segments the trainer talks to the whole pipeline (the loss is broadcast from the
last stage), so every transfer must start and finish inside one segment: a receive belongs
to the segment of the computation that produces its tensor on the sender, and within it is
placed at the sender's finish time (clamped to the receiver's first instruction of that
segment). A received gradient may then be consumed one segment later; the executor keeps its
buffer. ``pipeline.check.check_stream`` verifies every segment deadlock-free under blocking
rendezvous semantics and the concatenation equal to the uncut stream.

With unit costs the stream becomes periodic after the start-up (``steady_from`` steps): the
segments and drains from there on are the same lists with micro-batch ids shifted by ``m``,
so only the start-up and one steady segment are stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from shardwise.parallel.pipeline.schedules import (
    Backward,
    Forward,
    Instruction,
    OptimizerStep,
    RecvActivation,
    ScheduleError,
    SendActivation,
    SendGrad,
    compute_order,
    time_orders,
    timed_events,
    validate_args,
    warmup_forwards,
)

Lists = tuple[tuple[Instruction, ...], ...]  # one instruction list per pipeline rank


@dataclass(frozen=True)
class Stream:
    """Segments of PipeDream's flush-free stream for ``p`` stages and ``m`` micro-batches per
    step. ``segments[k]`` / ``drains[k]`` for ``k <= steady_from`` (global micro-batch ids);
    later steps repeat the last ones shifted by ``m`` per step."""

    p: int
    m: int
    steady_from: int
    segments: tuple[Lists, ...]
    drains: tuple[Lists, ...]

    def segment(self, k: int) -> Lists:
        """Per rank, the instructions of training step ``k`` (``k >= 0``) of the stream."""
        return self._at(self.segments, k)

    def drain(self, k: int) -> Lists:
        """Per rank, the backwards (and their optimizer steps and transfers) still pending
        after segment ``k``: running them empties the pipeline."""
        return self._at(self.drains, k)

    def _at(self, table: tuple[Lists, ...], k: int) -> Lists:
        if k < 0:
            raise ValueError(f"step {k} of a stream: expected k >= 0")
        if k <= self.steady_from:
            return table[k]
        return shift(table[self.steady_from], (k - self.steady_from) * self.m)


def shift(lists: Lists, by: int) -> Lists:
    """The same lists with every micro-batch id increased by ``by``."""
    return tuple(tuple(replace(op, mb=op.mb + by) for op in ops) for ops in lists)


def cut(p: int, m: int, steps: int) -> tuple[list[Lists], Lists]:
    """Simulate a stream of ``steps`` steps (``steps * m`` micro-batches) with unit costs;
    return its per-step segments and the drain after the last. See the module docstring."""
    total = steps * m
    orders = compute_order("pipedream", p, total)
    times = time_orders(orders, p)
    events = timed_events(orders, times, p, p, step_every_backward=True)
    seg_of: dict = {}  # (rank, compute) -> segment index; ``steps`` is the drain
    for r, order in enumerate(orders):
        tail = len(order) - warmup_forwards(p, total, 1, r)  # the trailing backwards: drain
        k = 0
        for i, op in enumerate(order):
            if isinstance(op, Forward):
                k = op.mb // m
            seg_of[(r, op)] = steps if i >= tail else k
    buckets: list[list[list[tuple]]] = [[[] for _ in range(steps + 1)] for _ in range(p)]
    for r, evs in enumerate(events):
        for t, prio, key, op in evs:
            buckets[r][_segment(op, r, p, seg_of)].append((t, prio, key, op))
    segments: list[list[tuple]] = [[] for _ in range(steps + 1)]
    for r in range(p):
        for k, bucket in enumerate(buckets[r]):
            starts = [t for t, _, _, op in bucket if isinstance(op, (Forward, Backward))]
            lo = min(starts) if starts else -math.inf
            bucket.sort(key=lambda e: (max(e[0], lo), e[1], e[2]))
            segments[k].append(tuple(e[3] for e in bucket))
    lists = [tuple(s) for s in segments]
    return lists[:steps], lists[steps]


def _segment(op, r: int, p: int, seg_of: dict) -> int:
    """The segment an event of rank ``r`` belongs to: a compute's own, an optimizer step its
    backward's, a transfer the producing computation's (on the sender)."""
    if isinstance(op, (Forward, Backward)):
        return seg_of[(r, op)]
    if isinstance(op, OptimizerStep):
        return seg_of[(r, Backward(op.mb, r))]
    if isinstance(op, SendActivation):
        return seg_of[(r, Forward(op.mb, op.chunk))]
    if isinstance(op, SendGrad):
        return seg_of[(r, Backward(op.mb, op.chunk))]
    if isinstance(op, RecvActivation):
        return seg_of[(op.peer, Forward(op.mb, op.chunk - 1))]
    return seg_of[(op.peer, Backward(op.mb, op.chunk + 1))]  # RecvGrad


@lru_cache(maxsize=64)
def stream(p: int, m: int) -> Stream:
    """PipeDream's stream for ``p`` stages, ``m`` micro-batches per step (Narayanan et al.
    2019). Raises ``ScheduleError`` on bad arguments, or if the cut stream does not become
    periodic (it does for every ``p``, ``m`` tried: 1..8 x 1..16)."""
    validate_args("pipedream", p, m)
    horizon = -(-(p - 1) // m) + 4  # the start-up spans ceil((p-1)/m) steps
    segs, drains = [], []
    for k in range(horizon):
        s, d = cut(p, m, k + 1)
        segs.append(s[k])
        drains.append(d)
    for k0 in range(horizon - 2):
        if all(shift(segs[k0], (j - k0) * m) == segs[j] and shift(drains[k0], (j - k0) * m) == drains[j]
               for j in range(k0 + 1, horizon)):
            return Stream(p, m, k0, tuple(segs[:k0 + 1]), tuple(drains[:k0 + 1]))
    raise ScheduleError(f"the PipeDream stream for p={p}, m={m} does not become periodic")


def time_stream(s: Stream, steps: int, forward_cost: float = 1.0,
                    backward_cost: float | None = None) -> list[dict]:
    """Ideal ``{op: (start, end)}`` of each of the first ``steps`` segments, run as the
    engine runs them: a segment starts on every rank once the previous one has ended on all
    (the loss broadcast between steps). Unit costs by default; backward = 2 x forward."""
    done: dict = {}
    out, start = [], 0.0
    for k in range(steps):
        orders = [[op for op in ops if isinstance(op, (Forward, Backward))] for ops in s.segment(k)]
        times = time_orders(orders, s.p, 1, forward_cost, backward_cost, done=done,
                            not_before=start)
        out.append(times)
        done.update(times)
        start = max(e for _, e in times.values())
    return out


def steady_bubble(p: int, m: int) -> float:
    """Idle fraction of a steady-state step of the stream: 1 - busy / (p x span of the step).
    No fill and no drain, but each step starts together after the loss broadcast, so rank r
    first waits r forwards for its input."""
    s = stream(p, m)
    times = time_stream(s, s.steady_from + 1)[-1]
    span = max(e for _, e in times.values()) - min(b for b, _ in times.values())
    return 1.0 - sum(e - b for b, e in times.values()) / (p * span)
