"""Tokens/s and bytes per rank of every feasible layout of one GPT at a given world size.

For each world size, one spawn of local gloo ranks (1 torch thread each) trains, in turn,
every dp x tp x pp layout whose sizes divide the model (heads by tp, layers by pp) and the
global batch, with ZeRO-0 and ZeRO-1 (and ZeRO-3 where pp = 1), on the same Shakespeare
batches: ``--warmup`` untimed steps, then ``--steps`` timed ones. Reports the median step
time as tokens/s (global batch x context / step) and the largest total of bytes any rank
holds (``Engine.memory_bytes``: parameters, gradients, optimizer states). Writes
``OUT/layouts_wsN.json``, a table ``OUT/layouts.txt`` and a PNG ``OUT/layouts.png``.

    python benchmarks/layouts.py --world-size 4 8 --steps 6 --out benchmarks/layout_results

On a 2-core machine 8 ranks share 2 cores: the figures rank layouts by what they cost in
compute and messages here, not by what they would do with a core per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "tie_weights": True}
BATCH = 16


def layouts(ws: int) -> list[dict]:
    """Every (dp, tp, pp, zero) at world size ``ws`` that the model and batch allow."""
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if ws % (tp * pp) or MODEL["n_head"] % tp or pp > MODEL["n_layer"] + 2:
                continue
            dp = ws // (tp * pp)
            m = 2 * pp if pp > 1 else 1
            if BATCH % (dp * m):
                continue
            for zero in ((0, 1, 3) if pp == 1 else (0, 1)):
                out.append({"dp": dp, "tp": tp, "pp": pp, "zero": zero, "micro_batches": m})
    return out


def _config(layout: dict, steps: int) -> dict:
    from shardwise.config import Config

    return Config.from_dict({
        "model": MODEL, "parallel": dict(layout, schedule="1f1b"),
        "optimizer": {"warmup_steps": 2},
        "training": {"steps": steps, "global_batch_size": BATCH, "eval_every": 0,
                     "progress": False, "sample_chars": 0, "out_dir": "/tmp/shardwise-layouts"},
        "checkpoint": {"at_end": False}}).model_dump()


def worker(configs: list[dict], warmup: int) -> list[dict]:
    from shardwise import comm
    from shardwise.config import Config
    from shardwise.topology import Topology, init_process_groups
    from shardwise.trainer import Trainer

    torch.set_num_threads(1)
    out = []
    for c in configs:
        cfg = Config.from_dict(c)
        p = cfg.parallel
        topo = init_process_groups(Topology.build(p.dp, p.pp, p.tp, rank=dist.get_rank(),
                                                  world_size=dist.get_world_size()))
        trainer = Trainer(cfg, topo)
        times = []
        for i in range(cfg.training.steps):
            comm.barrier()  # every rank starts the step together
            t0 = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - t0)
        mem = trainer.engine.memory_bytes()
        out.append({"step_s": statistics.median(times[warmup:]), "bytes": mem["total"],
                    "loss": trainer.history[-1]})
    return out


def run(ws: int, steps: int, warmup: int) -> list[dict]:
    from shardwise.launch import spawn

    lays = layouts(ws)
    configs = [_config(lay, steps + warmup) for lay in lays]
    results = spawn(worker, ws, (configs, warmup))
    tokens = BATCH * MODEL["block_size"]
    rows = []
    for i, lay in enumerate(lays):
        step = max(r[i]["step_s"] for r in results)
        rows.append({**lay, "tokens_per_s": tokens / step,
                     "max_bytes_per_rank": max(r[i]["bytes"] for r in results),
                     "loss": results[0][i]["loss"]})
    return rows


def _name(r: dict) -> str:
    return f"dp{r['dp']} tp{r['tp']} pp{r['pp']} z{r['zero']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "layout_results"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"GPT {MODEL['n_layer']} x {MODEL['n_embd']}, context {MODEL['block_size']}, "
             f"global batch {BATCH}; {os.cpu_count()} cores, gloo, 1 thread per rank; "
             f"median of {a.steps} steps after {a.warmup}; load average before: "
             f"{os.getloadavg()[0]:.2f}",
             f"{'ws':>3} {'layout':<20} {'m':>3} {'tokens/s':>9} {'MiB/rank':>9}"]
    all_rows = {}
    for ws in a.world_size:
        rows = run(ws, a.steps, a.warmup)
        all_rows[ws] = rows
        (out / f"layouts_ws{ws}.json").write_text(json.dumps(rows, indent=1))
        for r in sorted(rows, key=lambda r: -r["tokens_per_s"]):
            lines.append(f"{ws:>3} {_name(r):<20} {r['micro_batches']:>3} "
                         f"{r['tokens_per_s']:>9.0f} {r['max_bytes_per_rank'] / 2**20:>9.2f}")
    (out / "layouts.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(all_rows, out / "layouts.png", lines[0])


def _plot(all_rows: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_rows), figsize=(6 * len(all_rows), 5), squeeze=False)
    for ax, (ws, rows) in zip(axes[0], all_rows.items()):
        for z, marker in ((0, "o"), (1, "s"), (3, "^")):
            pts = [r for r in rows if r["zero"] == z]
            ax.scatter([r["max_bytes_per_rank"] / 2**20 for r in pts],
                       [r["tokens_per_s"] for r in pts], marker=marker, label=f"ZeRO-{z}")
            for r in pts:
                ax.annotate(f"{r['dp']}x{r['tp']}x{r['pp']}",
                            (r["max_bytes_per_rank"] / 2**20, r["tokens_per_s"]), fontsize=7)
        ax.set_xlabel("largest bytes held by a rank (MiB)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"world size {ws} (labels: dp x tp x pp)")
        ax.legend()
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
