"""Two facts behind how the local cluster is measured (``planner.hardware.shared_seconds``) and
how ``benchmarks/planner_local.py`` trains what it checks, on the GPT of
``benchmarks/layouts.py`` (4 x 128, context 64) with 8 gloo ranks (one thread each):

1. **A spawn per layout.** ``dp4 pp2 mb2 m2 1f1b z0`` trained in a spawn of its own, in one
   whose ranks first set up 7 more sets of the same process groups (no training in them),
   and in one whose ranks also built the 7 other layouts ``planner_local.py`` trains (only
   the first timed). The fastest and the median of 2 x 3 steps (the slowest rank each).
2. **The probe's depth.** How much slower than alone the ranks run when they share the
   cores depends on how much of a step the blocks' compute is: the dp step of 2 sequences
   a rank on the one-layer and the 4-layer model, over one rank alone on the same model
   times ranks per core (no all-reduce subtracted here).
3. **ZeRO-1/2's ring.** ``dp4 pp2 mb4 m1 1f1b`` with ZeRO 0, 1 and 2 (``planner_local``'s
   measurement: three spawns each, in turn; fastest, a fifth of the way up and the median
   of their steps) beside the planner's price of each on the ``local`` cluster calibrated
   at 8 ranks: ZeRO-1/2's reduce-scatter and all-gather are the engine's ring of send/recv
   steps, each of which waits for its peer to get a core (``comm_price.sharded_seconds``).

    python benchmarks/local_probe.py --out benchmarks/planner_results

Writes ``OUT/local_probe.txt``. About 3 minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import layouts as L  # noqa: E402  (the model and the global batch)
import planner_local as P  # noqa: E402  (a layout's train config, the planner's spec)

LAYOUT = "dp4 tp1 pp2 mb2 m2 1f1b z0"
WORLD = 8


def trained(configs: list[dict], extra_groups: int) -> list[float]:
    """One rank: build a trainer of each config (after ``extra_groups`` more sets of the
    first one's process groups), 3 untimed steps each, then 2 passes of 3 timed steps of
    the first only: their wall seconds."""
    import torch
    import torch.distributed as dist

    from shardwise import comm
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.base.config import Config
    from shardwise.base.topology import Topology, init_process_groups

    torch.set_num_threads(1)
    for _ in range(extra_groups):
        init_process_groups(Topology.build(dp=4, pp=2, rank=dist.get_rank(),
                                           world_size=dist.get_world_size()))
    trainers = [build_trainer(Config.from_dict(c)) for c in configs]
    for tr in trainers:
        for _ in range(3):
            tr.train_step()
    times = []
    for _ in range(2 * 3):
        comm.barrier()
        t0 = time.perf_counter()
        trainers[0].train_step()
        times.append(time.perf_counter() - t0)
    return times


def quantile(v: list[float]) -> float:
    """A fifth of the way up ``v`` sorted (``hardware.PROBE_QUANTILE``'s statistic)."""
    from shardwise.planner.hardware import PROBE_QUANTILE

    return sorted(v)[len(v) // PROBE_QUANTILE]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "planner_results"))
    a = ap.parse_args()
    from shardwise.data import CharTokenizer, load_text
    from shardwise.launch import spawn
    from shardwise.planner import hardware as H
    from shardwise.planner.search import plan

    vocab = CharTokenizer.from_text(load_text(None)).vocab_size
    spec = P.spec_of("gpt", vocab)
    cl = H.local_cluster(spec.n_embd, spec.block_size, spec.n_head, 1, spec=spec)
    ranked, _ = plan(spec, cl, WORLD, L.BATCH, precision="fp32",
                     memory_limit=cl.memory_per_rank(WORLD), top=4)
    lays = [ranked[i].layout for i in P.choose(ranked, 4, 4)]
    first = next(f.layout for f in ranked if f.layout.label() == LAYOUT)
    others = [lay for lay in lays if lay.label() != LAYOUT][:7]
    cfgs = [P.config("gpt", lay, 40) for lay in [first] + others]
    load0 = os.getloadavg()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"# python benchmarks/local_probe.py ({when}); {os.cpu_count()} cores, {WORLD} "
             f"gloo ranks, 1 thread each, load average before {load0[0]:.2f}", "",
             f"1. {LAYOUT} of the GPT, ms per step (fastest, median of 6; the slowest rank)"]
    cases = [("a spawn of its own", cfgs[:1], 0),
             ("after 7 more sets of its process groups", cfgs[:1], 7),
             (f"beside the {len(others)} other layouts' trainers", cfgs, 0)]
    for rep in range(a.repeats):
        for name, c, extra in cases:
            res = spawn(trained, WORLD, (c, extra))
            steps = sorted(max(r[k] for r in res) for k in range(len(res[0])))
            lines.append(f"   {name:<44} {steps[0] * 1e3:7.1f} "
                         f"{steps[len(steps) // 2] * 1e3:7.1f}")
            print(lines[-1], flush=True)
    lines += ["", "2. the probe's dp step over one rank alone x ranks per core (2 sequences a "
              "rank; dp's two spawns, a fifth of the way up)"]
    small = H.calibration_spec(spec, spec.block_size)
    for rep in range(a.repeats + 1):
        row = []
        for depth in (1, spec.n_layer):
            s = replace(small, n_layer=depth)
            alone = quantile(spawn(H._shared_probe, 1, (s, 1), threads=1,
                                   warn_shared_cores=False)[0][0])
            dp = []
            for _ in range(2):
                res = spawn(H._shared_probe, WORLD, (s, 1), threads=1, warn_shared_cores=False)
                dp += [max(r[0][i] for r in res) for i in range(len(res[0][0]))]
            ratio = quantile(dp) / (alone * WORLD / (os.cpu_count() or 1))
            row.append(f"{depth} layer{'s' if depth > 1 else ''}: alone {alone * 1e3:6.2f} ms, "
                       f"dp{WORLD} {quantile(dp) * 1e3:6.1f} ms, ratio {ratio:.2f}")
        lines.append("   " + " | ".join(row))
        print(lines[-1], flush=True)
    zeros = [f"dp4 tp1 pp2 mb4 m1 1f1b z{z}" for z in (0, 1, 2)]
    lines += ["", "3. ZeRO stages at one micro-batch, ms per step (fastest, a fifth of the way up, "
              "median of 3 spawns' steps) and the planner's price"]
    cl8 = H.local_cluster(spec.n_embd, spec.block_size, spec.n_head, WORLD, spec=spec)
    ranked8, _ = plan(spec, cl8, WORLD, L.BATCH, precision="fp32",
                      memory_limit=cl8.memory_per_rank(WORLD), top=500)
    by = {f.layout.label(): f for f in ranked8}
    rows = P.measure("gpt", WORLD, [by[z].layout for z in zeros], 3, 3, 3)
    for z, r in zip(zeros, rows):
        st = sorted(r["steps"])
        lines.append(f"   {z:<30} {st[0] * 1e3:7.1f} {st[len(st) // 5] * 1e3:7.1f} "
                     f"{st[len(st) // 2] * 1e3:7.1f}   planner {by[z].time['step'] * 1e3:6.1f}")
        print(lines[-1], flush=True)
    lines.append(f"contention {cl8.contention:.2f}, ring message "
                 f"{cl8.ring_message_s * 1e3:.2f} ms; load average after "
                 f"{os.getloadavg()[0]:.2f}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "local_probe.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
