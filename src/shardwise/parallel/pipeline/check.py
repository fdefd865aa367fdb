"""Validate a schedule without processes: order, matching, deadlock freedom, memory.

``check(schedule)`` verifies, for any ``Schedule`` (built here or by hand):

1. every chunk's forward and backward runs exactly once per micro-batch, on the rank that
   holds the chunk (``Schedule.rank_of``), the backward after the forward; a split backward
   runs its ``BackwardInput`` after the forward and its ``BackwardWeight`` after that; a
   fused schedule (``not Schedule.split``) runs no split one, a split schedule runs each
   pair's backward split or fused (DualPipeV has both), never both;
2. every input is there when used: a chunk's forward follows the receive of its input (or
   the local forward of the previous chunk), a backward follows the receive of its output
   gradient (or the local backward of the next chunk), a send follows what it sends;
3. every receive is matched by exactly one send of the same tensor, and the lists run to the
   end under *blocking rendezvous* semantics (a send waits until its peer posts the
   receive, and each rank runs its communication in list order, as ``shardwise.comm``'s
   one FIFO communication thread does), so the executor cannot deadlock;
4. flush schedules end with exactly one optimizer step per rank.

It returns the peak number of (micro-batch, chunk) activations held per rank: forwards done
whose backward (split: whose ``BackwardWeight``) has not run. Raises ``ScheduleError`` with
a one-line reason otherwise.

``check_stream(stream, steps)`` does the same for PipeDream's flush-free stream
(``pipeline.stream``) over ``steps`` training steps and the final drain: the concatenation is
checked as one schedule of ``steps * m`` micro-batches (1, 2), and each segment on its own
(3), because the trainer's collectives between steps must not overtake a pending transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.parallel.pipeline.schedules import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    Schedule,
    ScheduleError,
    SendActivation,
    SendGrad,
)


@dataclass(frozen=True)
class CheckReport:
    """``peak_in_flight[r]``: most activations rank ``r`` holds at once;
    ``forwards_before_backward[r]``: forwards it runs before its first backward (warm-up plus
    the first steady-state forward); ``steps[r]``: optimizer steps."""

    peak_in_flight: tuple[int, ...]
    forwards_before_backward: tuple[int, ...]
    steps: tuple[int, ...]


def _match_key(op, src: int):
    """What a send and its receive agree on: (tensor kind, mb, producing chunk, src, dst)."""
    if isinstance(op, SendActivation):
        return ("act", op.mb, op.chunk, src, op.peer)
    if isinstance(op, RecvActivation):
        return ("act", op.mb, op.chunk - 1, op.peer, src)
    if isinstance(op, SendGrad):
        return ("grad", op.mb, op.chunk, src, op.peer)
    return ("grad", op.mb, op.chunk + 1, op.peer, src)


def _check_rank(s: Schedule, r: int) -> tuple[int, int, int]:
    n, mine = s.n_chunks, set(s.chunks_of(r))
    done: set = set()
    received: set = set()
    live = peak = warmup = steps = 0
    seen_backward = False

    def grad_made(mb: int, chunk: int) -> bool:  # the input gradient of chunk on mb
        return Backward(mb, chunk) in done or BackwardInput(mb, chunk) in done

    for i, op in enumerate(s.ranks[r]):
        where = f"rank {r} instruction {i} ({op})"
        if isinstance(op, (BackwardInput, BackwardWeight)) and not s.split:
            raise ScheduleError(f"{where}: a fused schedule cannot run {type(op).__name__}")
        if isinstance(op, (Forward, Backward, BackwardInput, BackwardWeight)):
            if op.chunk not in mine or not 0 <= op.mb < s.m:
                raise ScheduleError(f"{where}: chunk/micro-batch not held by this rank")
            if op in done:
                raise ScheduleError(f"{where}: runs twice")
        if isinstance(op, (Backward, BackwardInput)) and grad_made(op.mb, op.chunk):
            raise ScheduleError(f"{where}: the backward already ran fused or split")
        if isinstance(op, Forward):
            if op.chunk > 0 and Forward(op.mb, op.chunk - 1) not in done \
                    and ("act", op.mb, op.chunk) not in received:
                raise ScheduleError(f"{where}: input not received yet")
            live, warmup = live + 1, warmup if seen_backward else warmup + 1
            peak = max(peak, live)
        elif isinstance(op, (Backward, BackwardInput)):
            if Forward(op.mb, op.chunk) not in done:
                raise ScheduleError(f"{where}: backward before its forward")
            if op.chunk < n - 1 and not grad_made(op.mb, op.chunk + 1) \
                    and ("grad", op.mb, op.chunk) not in received:
                raise ScheduleError(f"{where}: output gradient not received yet")
            live, seen_backward = live - isinstance(op, Backward), True
        elif isinstance(op, BackwardWeight):
            if BackwardInput(op.mb, op.chunk) not in done:
                raise ScheduleError(f"{where}: weight gradient before its input gradient")
            live -= 1
        elif isinstance(op, (SendActivation, SendGrad)) and op.peer != s.rank_of(
                op.chunk + (1 if isinstance(op, SendActivation) else -1)):
            raise ScheduleError(f"{where}: sent to a rank that does not hold the consumer")
        elif isinstance(op, SendActivation):
            if Forward(op.mb, op.chunk) not in done:
                raise ScheduleError(f"{where}: sends an activation not computed yet")
        elif isinstance(op, SendGrad):
            if not grad_made(op.mb, op.chunk):
                raise ScheduleError(f"{where}: sends a gradient not computed yet")
        elif isinstance(op, RecvActivation):
            received.add(("act", op.mb, op.chunk))
        elif isinstance(op, RecvGrad):
            received.add(("grad", op.mb, op.chunk))
        elif isinstance(op, OptimizerStep):
            steps += 1
        else:
            raise ScheduleError(f"{where}: not an instruction")
        done.add(op)
    for c in mine:
        for mb in range(s.m):
            fused = not s.split or Backward(mb, c) in done
            for op in ((Forward(mb, c), Backward(mb, c)) if fused
                       else (Forward(mb, c), BackwardInput(mb, c), BackwardWeight(mb, c))):
                if op not in done:
                    raise ScheduleError(f"rank {r} never runs {op}")
    if not s.weight_stashing and (steps != 1 or not isinstance(s.ranks[r][-1], OptimizerStep)):
        raise ScheduleError(f"rank {r}: a flush schedule ends with exactly one optimizer step")
    return peak, warmup, steps


def _check_blocking(s: Schedule) -> None:
    """Run every rank's list with rendezvous send/recv; raise on a deadlock."""
    comm = (SendActivation, RecvActivation, SendGrad, RecvGrad)
    sends = [_match_key(op, r) for r in range(s.p) for op in s.ranks[r]
             if isinstance(op, (SendActivation, SendGrad))]
    recvs = [_match_key(op, r) for r in range(s.p) for op in s.ranks[r]
             if isinstance(op, (RecvActivation, RecvGrad))]
    if sorted(sends) != sorted(recvs) or len(set(sends)) != len(sends):
        unmatched = set(sends) ^ set(recvs)
        raise ScheduleError(f"sends and receives do not pair up: {sorted(unmatched)[:3]}")
    pc = [0] * s.p
    while True:
        progressed = False
        for r in range(s.p):
            while pc[r] < len(s.ranks[r]) and not isinstance(s.ranks[r][pc[r]], comm):
                pc[r], progressed = pc[r] + 1, True
        for r in range(s.p):
            if pc[r] >= len(s.ranks[r]):
                continue
            op = s.ranks[r][pc[r]]
            if isinstance(op, (SendActivation, SendGrad)):
                q = op.peer
                if pc[q] < len(s.ranks[q]) and isinstance(s.ranks[q][pc[q]], (RecvActivation, RecvGrad)) \
                        and _match_key(s.ranks[q][pc[q]], q) == _match_key(op, r):
                    pc[r], pc[q], progressed = pc[r] + 1, pc[q] + 1, True
        if all(pc[r] >= len(s.ranks[r]) for r in range(s.p)):
            return
        if not progressed:
            stuck = {r: s.ranks[r][pc[r]] for r in range(s.p) if pc[r] < len(s.ranks[r])}
            raise ScheduleError(f"deadlock under blocking send/recv: {stuck}")


def check_stream(stream, steps: int) -> CheckReport:
    """Validate ``steps`` segments of a ``pipeline.stream.Stream`` and the drain after them
    (see the module docstring); the report covers the concatenation."""
    parts = [stream.segment(k) for k in range(steps)] + [stream.drain(steps - 1)]
    for k, lists in enumerate(parts):
        where = "the drain" if k == steps else f"segment {k}"
        try:
            _check_blocking(Schedule("pipedream", stream.p, stream.m, 1, lists, True))
        except ScheduleError as exc:
            raise ScheduleError(f"{where}: {exc}") from None
    whole = tuple(tuple(op for lists in parts for op in lists[r]) for r in range(stream.p))
    return check(Schedule("pipedream", stream.p, steps * stream.m, 1, whole, weight_stashing=True))


def check(s: Schedule) -> CheckReport:
    """Validate ``s`` (see the module docstring); return peaks, warm-ups and step counts."""
    if len(s.ranks) != s.p:
        raise ScheduleError(f"{len(s.ranks)} instruction lists for p={s.p} ranks")
    per_rank = [_check_rank(s, r) for r in range(s.p)]
    _check_blocking(s)
    return CheckReport(tuple(x[0] for x in per_rank), tuple(x[1] for x in per_rank),
                       tuple(x[2] for x in per_rank))
