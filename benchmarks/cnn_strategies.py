"""Pure data parallel, pure tensor parallel on the FC layers, the chosen hybrid, and each
convolution strategy (filters, channels, spatial; the fully connected layers as in tp-fc)
side by side: bytes each rank sends per step (measured by ``shardwise.comm``'s accounting,
beside the chooser's prediction) and step time, for the default CNN at 2 and 4 ranks.
``--model inception``: the CNN of configs/fashion_inception.toml (an Inception block after
conv2) under dp, ``branch`` (the block's branches placed on the ranks, the other layers
chosen) and the chooser's auto plan.
A convolution that cannot take the strategy keeps dp (channels: filters, its pair) and the
row says so: conv1 has one input channel; a spatial band must pool 2x2 on its own, so
28 x 28 splits into 2 bands only and 14 x 14 into none.

    python benchmarks/cnn_strategies.py                 # writes benchmarks/cnn_results/
    python benchmarks/cnn_strategies.py --steps 5 --ranks 2   # quicker
    python benchmarks/cnn_strategies.py --model inception --out inception

Each rank runs 1 torch thread; the plans take turns step by step (round robin), so load on
the machine hits them all alike. Random images of the Fashion-MNIST shape; ring
algorithms for every collective (so every byte is counted); argument-agreement rounds off.
Step time is the median over the timed steps of the slowest rank.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import tomllib
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.apps.cnn import choose, named_plans
from shardwise.apps.cnn.cost import allowed
from shardwise.apps.cnn.hybrid import HybridCNN
from shardwise.launch import spawn
from shardwise.models.cnn import CNN, CNNConfig, parse_branches
from shardwise.parallel.tensor_parallel import RankGroup

OUT = Path(__file__).resolve().parent / "cnn_results"
INCEPTION_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "fashion_inception.toml"
NAMES = {"cnn": ("dp", "tp-fc", "hybrid", "filters", "channels", "spatial"),
         "inception": ("dp", "branch", "auto")}


def model_config(model: str) -> CNNConfig:
    """The default CNN, or the sizes and branches of configs/fashion_inception.toml."""
    if model == "cnn":
        return CNNConfig()
    sec = tomllib.loads(INCEPTION_CONFIG.read_text())["cnn"]
    return CNNConfig(channels=tuple(sec["channels"]), hidden=tuple(sec["hidden"]),
                     inception=parse_branches(sec["inception"]))


def all_plans(specs, batch: int, n: int) -> dict:
    """The named plans, then one per convolution strategy (see the module docstring)."""
    plans = named_plans(specs, batch, n)
    fc = plans["tp-fc"].strategies[len([s for s in specs if s.kind == "conv"]):]
    for s in ("filters", "channels", "spatial"):
        conv = [s if s in allowed(sp, n) else {"channels": "filters"}.get(s, "dp")
                for sp in specs if sp.kind == "conv"]
        plans[s] = choose(specs, batch, n, fixed=conv + fc)
    return plans


def inception_plans(specs, batch: int, n: int) -> dict:
    """dp; the cheapest plan with the block placed by branches; the chooser's own."""
    return {"dp": choose(specs, batch, n, fixed=["dp"] * len(specs)),
            "branch": choose(specs, batch, n, restrict={"inception": ("branch",)}),
            "auto": choose(specs, batch, n)}


def labels(plan) -> list[str]:
    """Each layer's strategy, a branch block's with its branches per rank: branch[3x3 | 5x5]."""
    return [lp.strategy + ("" if not lp.placement else "[" + " | ".join(
        ",".join(spec.branches[j].kind for j in m) or "-" for m in lp.placement) + "]")
        for spec, lp in zip(plan.specs, plan.layers)]


def worker(model: str, batch: int, steps: int, warmup: int) -> dict:
    n, rank = dist.get_world_size(), dist.get_rank()
    comm.configure(check=False)
    group = RankGroup(group=dist.group.WORLD, size=n, rank=rank, all_reduce="ring", gather="ring")
    cfg = model_config(model)
    names = NAMES[model]
    plans = (all_plans if model == "cnn" else inception_plans)(CNN(cfg).specs(), batch, n)
    models, opts = {}, {}
    for name in names:
        torch.manual_seed(0)
        models[name] = HybridCNN(CNN(cfg), plans[name], group)
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    times = {k: [] for k in names}
    sent = {}
    for step in range(warmup + steps):
        x = torch.rand(batch, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        for name in names:
            m, opt = models[name], opts[name]
            dist.barrier()
            t0 = time.perf_counter()
            with comm.accounting.recording() as rec:
                m.zero_grad()
                m.loss_and_backward(x, y)
                m.sync_gradients()
            opt.step()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # outside the accounting: not counted
            if step >= warmup:
                times[name].append(float(dt))
            sent[name] = sum(r.bytes_sent for r in rec.records)
    return {name: {"strategies": labels(plans[name]), "bytes_sent": sent[name],
                   "bytes_predicted": plans[name].bytes_per_step,
                   "step_s": statistics.median(times[name]),
                   "predicted_s": plans[name].seconds} for name in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--model", choices=tuple(NAMES), default="cnn")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="strategies", help="file name (no suffix) under "
                    "benchmarks/cnn_results/")
    a = ap.parse_args()
    load_before = os.getloadavg()
    rows = []
    for n in a.ranks:
        res = spawn(worker, n, (a.model, a.batch, a.steps, a.warmup), threads=1)
        for name in NAMES[a.model]:
            mean_sent = sum(r[name]["bytes_sent"] for r in res) / n
            r0 = res[0][name]
            rows.append({"ranks": n, "plan": name, "strategies": r0["strategies"],
                         "bytes_sent_per_rank": mean_sent, "bytes_predicted": r0["bytes_predicted"],
                         "step_ms": 1e3 * r0["step_s"], "predicted_ms": 1e3 * r0["predicted_s"]})
    meta = {"model": a.model, "world_sizes": a.ranks, "machine": platform.node(),
            "cores": len(os.sched_getaffinity(0)),
            "threads_per_rank": 1, "batch": a.batch, "steps": a.steps, "warmup": a.warmup,
            "torch": torch.__version__, "load_average_after": os.getloadavg(),
            "load_average_before": load_before}
    OUT.mkdir(exist_ok=True)
    OUT.joinpath(a.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1)
                                             + "\n")
    layers = ", ".join(s.name for s in CNN(model_config(a.model)).specs())
    lines = [f"| ranks | plan | strategies ({layers}) | bytes sent / rank / step "
             "| predicted bytes | step time (ms) |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        cells = ", ".join(r["strategies"]).replace("|", "\\|")  # a branch's ranks
        lines.append(f"| {r['ranks']} | {r['plan']} | {cells} | "
                     f"{r['bytes_sent_per_rank']:,.0f} | {r['bytes_predicted']:,.0f} | "
                     f"{r['step_ms']:.1f} |")
    table = "\n".join(lines)
    OUT.joinpath(a.out + ".md").write_text(f"{json.dumps(meta)}\n\n{table}\n")
    print(json.dumps(meta))
    print(table)
    off = [f"{r['ranks']} ranks {r['plan']}" for r in rows
           if r["bytes_sent_per_rank"] != r["bytes_predicted"]]
    if off:
        raise SystemExit("measured bytes differ from the prediction: " + ", ".join(off))


if __name__ == "__main__":
    main()
