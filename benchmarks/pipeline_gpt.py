"""Real pipelined GPT runs: timeline pictures and peak activation memory per rank.

For each schedule, trains the GPT for ``--steps`` steps at pp = ``--pp`` with ``--micro-batches``
micro-batches (stages cut by profiled time), saves the last step's timeline under
``RUN_DIR/<kind>/timeline/`` and draws ``OUT/pipeline_<kind>.png`` from it (the same as
``shardwise timeline RUN_DIR/<kind>``); PipeDream's last step is a steady-state segment of
its stream, with micro-batches of the previous step still in flight at its start. Then measures the peak bytes autograd holds for
backward on every rank (``Executor.meter``) for GPipe, 1F1B and 1F1B with recomputation.

    .venv/bin/python benchmarks/pipeline_gpt.py --pp 4 --micro-batches 8 --out docs/images
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.base.topology import Topology, init_process_groups
from shardwise.engine import Engine, EngineConfig
from shardwise.launch import spawn
from shardwise.models import GPTConfig
from shardwise.parallel.pipeline import timeline

TIMELINES = (("gpipe", 1, False), ("1f1b", 1, False), ("interleaved", 2, False),
             ("pipedream", 1, False))
MEMORY = (("gpipe", 1, False), ("1f1b", 1, False), ("1f1b", 1, True))


def _train(a: dict, kind: str, v: int, recompute: bool, topo, run_dir: str | None) -> dict:
    cfg = GPTConfig(vocab_size=65, block_size=a["seq"], n_layer=a["layers"], n_head=4,
                    n_embd=a["embd"], tie_weights=False)
    engine = Engine(cfg, topo, EngineConfig(
        seq_len=a["seq"],
        parallel={"schedule": kind, "micro_batches": a["m"], "chunks_per_rank": v,
                  "partition": a["partition"], "recompute": recompute},
        optimizer={"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.01,
                   "grad_clip": 0.0},
        training={"seed": 0, "global_batch_size": a["batch"]}), measure_memory=True)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(a["steps"]):
        idx = torch.randint(0, 65, (a["batch"], a["seq"]), generator=g)
        losses.append(engine.train_step(idx, (idx + 1) % 65)["loss"])
    if run_dir:
        title = (f"{kind} pp={topo.pp} m={a['m']}" + (f" v={v}" if v > 1 else "")
                 + f", GPT n_layer={a['layers']} n_embd={a['embd']}, measured"
                 + (f", step {a['steps'] - 1} of the stream" if kind == "pipedream" else ""))
        engine.save_timeline(run_dir, title)
    return {"peak": engine.executor.meter.peak, "losses": losses,
            "bounds": list(engine.partition.bounds)}


def _timelines(a: dict) -> list[tuple]:
    return [t for t in TIMELINES if t[0] in a["kinds"]]


def _run(a: dict, run_dir: str) -> dict:
    topo = init_process_groups(Topology.build(1, dist.get_world_size(), 1, rank=dist.get_rank(),
                                              world_size=dist.get_world_size()))
    out = {}
    for kind, v, rc in _timelines(a):
        out[f"timeline {kind}"] = _train(a, kind, v, rc, topo, f"{run_dir}/{kind}")
    if a["no_memory"]:
        return out
    for kind, v, rc in MEMORY:
        out[f"memory {kind}{' +recompute' if rc else ''}"] = _train(a, kind, v, rc, topo, None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--micro-batches", dest="m", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--partition", default="params")
    ap.add_argument("--out", default="docs/images")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--kinds", nargs="+", default=[k for k, _, _ in TIMELINES],
                    help="timelines to draw (default: all)")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    a = vars(ap.parse_args())
    run_dir = a["run_dir"] or tempfile.mkdtemp(prefix="pipeline_runs_")
    res = spawn(_run, a["pp"], (a, run_dir), threads=1)
    for kind, _, _ in _timelines(a):
        events, meta = timeline.load(f"{run_dir}/{kind}")
        png = timeline.render(events, Path(a["out"]) / f"pipeline_{kind}.png", meta["title"])
        print(f"{png}: idle fraction {timeline.idle_fraction(events):.3f} "
              f"(stages {res[0][f'timeline {kind}']['bounds']}; run dir {run_dir}/{kind})")
    print(f"\npeak activation memory per rank (KiB), pp={a['pp']} m={a['m']} "
          f"micro-batch {a['batch'] // a['m']} x {a['seq']} tokens:")
    for key in res[0]:
        if key.startswith("memory"):
            print(f"  {key[7:]:20} " + "  ".join(f"{r[key]['peak'] / 1024:9.0f}" for r in res))


if __name__ == "__main__":
    main()
