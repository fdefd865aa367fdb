"""Zero-bubble schedules measured: idle fraction and step time of 1f1b, interleaved, zb1p, zbv
and dualpipev, and ours against torch's ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble
and ScheduleDualPipeV on the same chunks and micro-batches (gloo, one thread per rank).

Every chunk is the same equal-cost stage whose backward has both halves: its output is
``SleepX(x) * SleepW(w)``; ``SleepX`` holds the rank ``--ms / v`` milliseconds in its forward
and in its backward (the input gradient, B), ``SleepW`` in its backward only (the weight
gradient, W), so F = B = W as on the ideal machine and a fused backward takes B + W. Sleeping
stands for a device that runs beside the others: p = 4 ranks on 2 shared cores then measure
the schedule and its executor, not the contention for cores (``pipeline_bubble.py`` does
the same for fused schedules). Activations (batch / m, hidden) travel through each side's own
p2p (ours: ``shardwise.comm``; torch: its stages' batched isend/irecv), over gloo.

A step is one whole schedule, forward and backward, on one batch of ``m`` micro-batches (no
optimizer: both sides would run the same one). Each repeat runs every configuration for
``--steps`` steps after a warm-up one, in an order reversed every repeat; the median step
over all repeats is reported. Idle fraction: ``timeline`` is ours from the executor's
recorded events (``timeline.idle_fraction``); ``from step`` is 1 - (the rank's compute,
``m * 3 * ms``) / (the step time), for both sides, so it also counts each executor's own
overhead. ``ratio``: torch's median step over ours (> 1: ours is faster). Losses (the mean
over micro-batches of the first step) must agree.

``--recompute both``: ours only, 1f1b, zb1p, zbv and dualpipev each without and with per-chunk
recomputation (``Executor(recompute=True)``, ``parallel.recompute = "stage"``): the forward runs
under ``no_grad`` and the backward (fused, or B) reruns it, so B costs F + B and the rank's
compute is ``m * 4 * ms``; ``ideal`` is then the schedule's lists timed with B = 2 F (fused
backward 3 F), W = F. ``ratio``: the step with recomputation over the step without.

    .venv/bin/python benchmarks/zero_bubble.py --pp 4 --micro-batches 8 --repeats 5
    .venv/bin/python benchmarks/zero_bubble.py --recompute both --repeats 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.launch import spawn
from shardwise.parallel.pipeline import timeline
from shardwise.parallel.pipeline.bubble import ideal_bubble
from shardwise.parallel.pipeline.executor import Executor
from shardwise.parallel.pipeline.schedules import (
    COMPUTE_STREAM, Backward, BackwardInput, BackwardWeight, Forward, _deps, compute_order,
    placement_of, schedule, time_lists)

OURS = (("1f1b", 1), ("interleaved", 2), ("zb1p", 1), ("zbv", 2), ("dualpipev", 2))
TORCH = (("zb1p", "ScheduleInterleavedZeroBubble", 1), ("zbv", "ScheduleZBVZeroBubble", 2),
         ("dualpipev", "ScheduleDualPipeV", 2))
RECOMPUTE = (("1f1b", 1), ("zb1p", 1), ("zbv", 2), ("dualpipev", 2))


class _SleepX(torch.autograd.Function):
    """Identity on the input path: sleeps in the forward and in the backward (B)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g * 1.0, None


class _SleepW(torch.autograd.Function):
    """Identity on the weight path: sleeps in the backward only (W)."""

    @staticmethod
    def forward(ctx, w, seconds):
        ctx.seconds = seconds
        return w * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g * 1.0, None


class SplitSleepStage(nn.Module):
    """A chunk of F = B = W = ``seconds``: ``SleepX(x) * SleepW(w)``, x (B, H), w (H,)."""

    def __init__(self, seconds: float, hidden: int, chunk: int):
        super().__init__()
        self.seconds = seconds
        g = torch.Generator().manual_seed(chunk)
        self.w = nn.Parameter(1.0 + 0.01 * torch.randn(hidden, generator=g))

    def forward(self, x):
        return _SleepX.apply(x, self.seconds) * _SleepW.apply(self.w, self.seconds)


def _loss(y, t):
    return (y - t).pow(2).mean()


def _chunks(ids, a, v):
    return {c: SplitSleepStage(a["ms"] / 1e3 / v, a["hidden"], c) for c in ids}


def _ours(a, kind: str, v: int, rank: int, p: int, recompute: bool = False):
    s = schedule(kind, p, a["m"], v)
    ex = Executor(s, rank, _chunks(s.chunks_of(rank), a, v), list(range(p)),
                  (a["batch"] // a["m"], a["hidden"]), loss_fn=_loss, on_step=lambda: None,
                  recompute=recompute)

    def step(x, t):
        losses = ex.run(list(x.chunk(a["m"])), list(t.chunk(a["m"])))
        return float(torch.stack(losses).mean()) if losses else None
    return step, ex


def _torch(a, name: str, v: int, rank: int, p: int):
    from torch.distributed import pipelining as tpp

    place = placement_of("zbv" if name != "ScheduleInterleavedZeroBubble" else "zb1p", p, v)
    ids = [c for c, r in enumerate(place) if r == rank]
    chunks = _chunks(ids, a, v)
    stages = [tpp.PipelineStage(chunks[c], c, p * v, torch.device("cpu")) for c in ids]
    sched = getattr(tpp, name)(stages, a["m"], loss_fn=_loss)
    first, last = 0 in ids, p * v - 1 in ids

    def step(x, t):
        losses: list = []
        sched.step(*((x,) if first else ()), target=t if last else None,
                   losses=losses if last else None)
        for c in chunks.values():  # no optimizer: drop the gradients, as ours are kept
            c.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if losses else None
    return step, None


def _ideal(kind: str, p: int, m: int, v: int, recompute: bool) -> float:
    """Ideal-machine idle fraction of ``kind``'s compute orders with F = W = 1 / v per chunk
    and B = (2 if ``recompute`` else 1) / v (a fused backward B + W)."""
    if not recompute:
        return ideal_bubble(kind, p, m, v)
    orders = compute_order(kind, p, m, v)
    split = {(op.mb, op.chunk) for o in orders for op in o if isinstance(op, BackwardInput)}
    cost = {Forward: 1.0, BackwardInput: 2.0, BackwardWeight: 1.0, Backward: 3.0}
    times = time_lists(orders, lambda r, op: (COMPUTE_STREAM, _deps(op, p * v, split),
                                              cost[type(op)] / v)).times
    span = max(e for _, e in times.values())
    return 1.0 - sum(e - s for s, e in times.values()) / (p * span)


def _sides(a: dict) -> dict:
    """``{row name: (kind, v, recompute, torch schedule name or None)}``, in run order."""
    if a["recompute"] == "both":
        return {f"ours {k}{' +recompute' if r else ''}": (k, v, r, None)
                for k, v in RECOMPUTE for r in (False, True)}
    rows = {f"ours {k}": (k, v, False, None) for k, v in OURS}
    rows.update({f"torch {n}": (k, v, False, n) for k, n, v in TORCH})
    return rows


def _run(a: dict) -> dict:
    rank, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(a["batch"], a["hidden"], generator=g),
             torch.randn(a["batch"], a["hidden"], generator=g)) for _ in range(a["steps"] + 1)]
    sides = {name: _ours(a, k, v, rank, p, r) if n is None else _torch(a, n, v, rank, p)
             for name, (k, v, r, n) in _sides(a).items()}
    times: dict = {k: [] for k in sides}
    idle: dict = {k: [] for k in sides}
    first: dict = {}
    for rep in range(a["repeats"]):
        for name in (list(sides) if rep % 2 == 0 else list(sides)[::-1]):
            fn, ex = sides[name]
            for s, (x, t) in enumerate(data):
                dist.barrier()
                t0 = time.perf_counter()
                loss = fn(x, t)
                dt = time.perf_counter() - t0
                if s == 0:
                    first.setdefault(name, loss)
                    continue
                times[name].append(dt)
                if ex is not None:
                    gathered = [None] * p
                    dist.all_gather_object(gathered, timeline.from_executor(ex, rank))
                    idle[name].append(timeline.idle_fraction([e for q in gathered for e in q]))
    return {k: (times[k], idle[k], first[k]) for k in sides}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", dest="p", type=int, default=4)
    ap.add_argument("--micro-batches", dest="m", type=int, default=8)
    ap.add_argument("--ms", type=float, default=20.0, help="F (= B = W) ms per stage")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--recompute", choices=("off", "both"), default="off",
                    help="both: ours only, each schedule without and with recomputation")
    a = vars(ap.parse_args())
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    res = spawn(_run, a["p"], (a,), threads=1)
    wall = time.perf_counter() - t0
    p, m, ms = a["p"], a["m"], a["ms"]
    print(f"{platform.node()}: {os.cpu_count()} cores, torch {torch.__version__}, gloo, "
          f"p={p} ranks x 1 thread; load average {load0[0]:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after ({wall:.0f} s)")
    print(f"chunks: F = B = W = {ms:g} ms / v (sleep), batch {a['batch']} x {a['hidden']}, "
          f"m={m}; median of {a['repeats']} x {a['steps']} alternated steps")
    print(f"{'schedule':36} {'v':>2} {'step ms':>8} {'idle: timeline':>14} {'from step':>9} "
          f"{'ideal':>6} {'loss':>9}")
    row, meta = {}, _sides(a)
    for name in res[0]:
        steps = [max(r[name][0][i] for r in res) for i in range(len(res[0][name][0]))]
        step = statistics.median(steps)
        idle = statistics.median(res[0][name][1]) if res[0][name][1] else None
        loss = next(r[name][2] for r in res if r[name][2] is not None)
        kind, v, rec, _ = meta[name]
        work = m * (4 if rec else 3) * ms / 1e3  # a rank's compute per step, seconds
        row[name] = step
        shown = f"{idle:14.3f}" if idle is not None else f"{'-':>14}"
        print(f"{name:36} {v:>2} {step * 1e3:8.1f} {shown} {1 - work / step:9.3f} "
              f"{_ideal(kind, p, m, v, rec):6.3f} {loss:9.6f}")
    if a["recompute"] == "both":
        for kind, _ in RECOMPUTE:
            print(f"ratio {kind} with recomputation / without: "
                  f"{row[f'ours {kind} +recompute'] / row[f'ours {kind}']:.3f}")
        return
    for kind, tname, _ in TORCH:
        print(f"ratio torch {tname} / ours {kind}: "
              f"{row[f'torch {tname}'] / row[f'ours {kind}']:.3f}")


if __name__ == "__main__":
    main()
