"""Measured pipeline bubble with equal-cost stages against (p-1)/(m+p-1).

Each of the ``p * v`` chunks is the same stage: ``--work sleep`` (default) holds the rank for
``--ms`` milliseconds per forward (divided by v) and twice that per backward, like a device
that runs in parallel with the others, so 4 ranks on 2 cores still measure the schedule and
the executor rather than core contention; ``--work matmul`` does real (B, H) x (H, H)
matmuls of about that cost (meaningful only when ranks <= cores). Activations (B, H) travel
through the real executor and ``shardwise.comm``. The idle fraction is read from the
recorded timeline of each step (``timeline.idle_fraction``); configurations alternate (order
reversed every repeat) and the median over repeats is reported. ``pipedream`` is measured on
a steady-state step of its stream (the start-up segments run first, each followed by the
loss broadcast the runner does), against ``ideal_bubble`` = (p-1)/(3m+p-1).

    .venv/bin/python benchmarks/pipeline_bubble.py --pp 2 4 --micro-batches 1 4 8 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise import comm
from shardwise.launch import spawn
from shardwise.parallel.pipeline import timeline
from shardwise.parallel.pipeline.bubble import ideal_bubble
from shardwise.parallel.pipeline.executor import Executor
from shardwise.parallel.pipeline.schedules import ScheduleError, schedule
from shardwise.parallel.pipeline.stream import stream


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(2 * ctx.seconds)
        return g * 1.0, None


class SleepStage(nn.Module):
    def __init__(self, seconds: float, hidden: int):
        super().__init__()
        self.seconds = seconds
        self.w = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return _Sleep.apply(x * self.w, self.seconds)


def matmul_stage(hidden: int, layers: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])


def _run(cfgs: list[tuple], work: str, ms: float, hidden: int, batch: int, repeats: int) -> list:
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    results = {c: [] for c in cfgs}
    for rep in range(repeats + 1):  # repeat 0 warms up
        for cfg in (cfgs if rep % 2 else cfgs[::-1]):
            kind, m, v = cfg
            s = schedule(kind, p, m, v)
            chunks = {c: (SleepStage(ms / 1e3 / v, hidden) if work == "sleep"
                          else matmul_stage(hidden, max(1, round(4 / v)))) for c in s.chunks_of(rank)}
            ex = Executor(s, rank, chunks, list(range(p)), (batch, hidden),
                          loss_fn=lambda y, t: (y - t).pow(2).mean(), on_step=lambda: None)
            xs = [torch.randn(batch, hidden) for _ in range(m)]
            if kind == "pipedream":  # up to the first steady-state step of the stream
                st = stream(p, m)
                for k in range(st.steady_from + 1):
                    comm.broadcast(torch.zeros(1), src=p - 1)  # as the runner's loss broadcast
                    ex.run(xs, xs, st.segment(k)[rank], first_mb=k * m)
            else:
                ex.run(xs, xs)
            events = timeline.from_executor(ex, rank)
            gathered = [None] * p
            dist.all_gather_object(gathered, events)  # harness only: collect timelines
            if rep:
                results[cfg].append(timeline.idle_fraction([e for g in gathered for e in g]))
    return [(c, results[c]) for c in cfgs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", dest="p", type=int, nargs="+", default=[2, 4], help="pipeline stages")
    ap.add_argument("--micro-batches", dest="m", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--kinds", nargs="+", default=["gpipe", "1f1b", "interleaved"])
    ap.add_argument("--chunks-per-rank", dest="v", type=int, default=2,
                    help="chunks per rank for interleaved")
    ap.add_argument("--work", choices=["sleep", "matmul"], default="sleep")
    ap.add_argument("--ms", type=float, default=20.0, help="forward ms per stage")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"work={args.work} forward={args.ms} ms/stage, repeats={args.repeats} (median)")
    print(f"{'kind':12} {'p':>2} {'m':>2} {'v':>2} {'measured':>9} {'formula':>8} {'rel.diff':>8}")
    for p in args.p:
        cfgs = []
        for kind in args.kinds:
            for m in args.m:
                v = args.v if kind == "interleaved" else 1
                try:
                    schedule(kind, p, m, v)
                except ScheduleError:
                    continue
                cfgs.append((kind, m, v))
        out = spawn(_run, p, (cfgs, args.work, args.ms, args.hidden, args.batch, args.repeats),
                    threads=1)[0]
        for (kind, m, v), fractions in out:
            med, ideal = statistics.median(fractions), ideal_bubble(kind, p, m, v)
            rel = (med - ideal) / ideal if ideal else 0.0
            print(f"{kind:12} {p:>2} {m:>2} {v:>2} {med:9.3f} {ideal:8.3f} {rel:+8.1%}", flush=True)


if __name__ == "__main__":
    main()
