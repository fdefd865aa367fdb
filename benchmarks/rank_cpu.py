"""Where a local step's time goes: each rank's CPU seconds against the step's wall time.

For a few layouts of the GPT of ``benchmarks/layouts.py`` (4 x 128, context 64, global batch
16) at one world size of local gloo ranks (one torch thread each), trains each layout as
``shardwise plan --emit-toml`` writes it and reports, for the fastest of ``--steps`` steps
(after 3 untimed): its wall time (the slowest rank), the CPU seconds every rank spent in it
(``getrusage``: the comm thread's and gloo's included), how busy that kept the cores
(CPU / (wall x cores)), and the planner's prediction for it on the ``local`` cluster
calibrated now. The evidence behind ``Cluster.contention`` and ``Cluster.ring_message_s``
(docs/planner.md): the cores stay busy, so the time missing from the model is work, not
waiting. Last, one rank alone training the whole model on a dp rank's share of the batch
(16 / world size sequences): what that work costs without the others.

    python benchmarks/rank_cpu.py --world-size 4
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import planner_local as P  # noqa: E402  (the train config of a layout, the planner's spec)

LAYOUTS = {  # (dp, pp, cp, micro-batch size, micro-batches) at each world size
    4: [(4, 1, 1, 4, 1), (2, 2, 1, 4, 2), (1, 4, 1, 2, 8), (1, 1, 4, 16, 1)],
    8: [(8, 1, 1, 2, 1), (4, 2, 1, 2, 2), (2, 1, 4, 8, 1)],
}


def worker(configs: list[dict], steps: int) -> list[dict]:
    """Per layout: each timed step's wall seconds and this process's CPU seconds."""
    import torch

    from shardwise import comm
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.base.config import Config

    torch.set_num_threads(1)
    out = []
    for c in configs:
        tr = build_trainer(Config.from_dict(c))
        for _ in range(3):
            tr.train_step()
        walls, cpus = [], []
        for _ in range(steps):
            comm.barrier()
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            tr.train_step()
            t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            walls.append(t1 - t0)
            cpus.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        out.append({"walls": walls, "cpus": cpus})
        del tr
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=4, choices=sorted(LAYOUTS))
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    from shardwise.launch import spawn
    from shardwise.planner.hardware import local_cluster
    from shardwise.planner.layout import Layout
    from shardwise.planner.simulate import simulate

    ws, load0 = a.world_size, os.getloadavg()[0]
    spec = P.spec_of("gpt", 65)
    cl = local_cluster(spec.n_embd, spec.block_size, spec.n_head, ws, spec=spec)
    lays = [Layout(dp, 1, pp, mb, m, cp=cp) for dp, pp, cp, mb, m in LAYOUTS[ws]]
    res = spawn(worker, ws, ([P.config("gpt", lay, 3 + a.steps + 2) for lay in lays], a.steps))
    cores = os.cpu_count() or 1
    print(f"gpt 4 x 128 of benchmarks/layouts.py, global batch 16, {ws} ranks on {cores} "
          f"cores, 1 thread each; fastest of {a.steps} steps after 3; contention "
          f"{cl.contention:.2f}, ring message {cl.ring_message_s * 1e3:.2f} ms; load average "
          f"before {load0:.2f}, after {os.getloadavg()[0]:.2f}")
    print(f"{'layout':<32} {'wall ms':>8} {'CPU ms per rank':>22} {'busy':>5} {'predicted':>9}")
    for i, lay in enumerate(lays):
        walls = [max(r[i]["walls"][k] for r in res) for k in range(a.steps)]
        k = min(range(a.steps), key=walls.__getitem__)
        cpus = [r[i]["cpus"][k] for r in res]
        pred = simulate(spec, lay, cl, "fp32")["step"]
        print(f"{lay.label():<32} {walls[k] * 1e3:>8.1f} "
              f"{' '.join(f'{c * 1e3:.1f}' for c in cpus):>22} "
              f"{sum(cpus) / walls[k] / cores:>5.2f} {pred * 1e3:>9.1f}")
    alone = Layout(1, 1, 1, 16 // ws, 1)
    cfg = P.config("gpt", alone, 3 + a.steps + 2)
    cfg["training"]["global_batch_size"] = 16 // ws
    one = spawn(worker, 1, ([cfg], a.steps))[0][0]
    k = min(range(a.steps), key=one["walls"].__getitem__)
    print(f"{'one rank alone, ' + str(16 // ws) + ' sequences':<32} {one['walls'][k] * 1e3:>8.1f} "
          f"{one['cpus'][k] * 1e3:>22.1f}")


if __name__ == "__main__":
    main()
