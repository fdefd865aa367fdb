"""Planner vs measurement on this machine: the layouts ``plan --cluster local`` ranks, trained.

For each model (the GPT and the Llama of ``benchmarks/layouts.py``: 4 x 128, context 64,
global batch 16, Shakespeare) and world size (4 and 8 local gloo ranks, one thread each):
calibrate the ``local`` cluster now (``planner.hardware.local_cluster``: the planned
model's block, the optimizer step, the host's seconds per step and micro-batch, and at the
world size the ranks' contention and the cp ring's seconds per message),
let the planner rank every layout its search keeps (``planner.search.plan``, the search
``shardwise plan --cluster local`` runs), and train its ``--top`` best and ``--spread``
more spaced evenly down the rest of its ranking (so that the rank correlation sees the
planner's whole range, not only near-ties), each layout as ``shardwise plan --emit-toml``
would write it (``cli.plan.parallel_table``), each in a spawn of ranks of its own (as
``shardwise train`` runs one: ranks that also hold other layouts' process groups run 13-23%
slower, ``benchmarks/local_probe.py``).

Measured step time: the fastest step among those no other process disturbed (foreign CPU
below 0.15 cores, ``comm.quiet``), over three passes through the layouts, a spawn each (a
burst of load that hits one layout in one pass seldom hits it in all; how a spawn's ranks
happen to share the cores moves its steps by several percent); the fastest of all when
none was quiet, flagged. On a shared 2-core machine other work only ever adds time.
Reported per layout: the error (predicted / measured - 1); per model and world size: the
median and worst absolute error, Spearman's rank correlation, the planner's rank of the
measured-fastest layout, how much slower its first choice measured, and the load average
before and after. Writes
``OUT/planner_local.json``, ``OUT/planner_local.txt`` and a scatter ``OUT/planner_local.png``.

    python benchmarks/planner_local.py --out benchmarks/planner_results

It took 7 min 15 s (2026-12-02 13:51 UTC, load average 7.1 from the run before it; the
probes of `local_cluster` included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import layouts as L  # noqa: E402  (the models and the global batch)


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation of ``x`` and ``y`` (ties: average ranks)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):  # average ranks over ties
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else 0.0


def quiet_worker(configs: list[dict], warmup: int, steps: int, passes: int) -> list[dict]:
    """Per layout: ``warmup`` untimed steps, then ``passes`` passes through every layout,
    each timing steps until ``steps`` of them saw no foreign load (``comm.quiet``; at most
    2 x ``steps`` + 1). Per step, this rank's seconds and rank 0's foreign load."""
    import torch
    import torch.distributed as dist

    from shardwise import comm
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.base.config import Config
    from shardwise.comm import quiet

    torch.set_num_threads(1)
    pids = quiet.rank_pids()  # collective: every rank
    foreign = quiet.Foreign(pids) if dist.get_rank() == 0 else None
    trainers = [build_trainer(Config.from_dict(c)) for c in configs]
    out = [{"times": [], "loads": []} for _ in configs]
    for tr in trainers:
        for _ in range(warmup):
            tr.train_step()
    for _ in range(passes):
        for tr, o in zip(trainers, out):
            def one(i: int, tr=tr, o=o) -> None:
                comm.barrier()  # every rank starts the step together
                t0 = time.perf_counter()
                tr.train_step()
                o["times"].append(time.perf_counter() - t0)

            o["loads"] += quiet.repeat_until_quiet(one, steps, 2 * steps + 1, foreign)
    return out


def config(model: str, lay, steps: int) -> dict:
    """The train config of ``lay`` (a planner ``Layout``) on ``model``, as ``plan
    --emit-toml`` writes its parallel section."""
    from shardwise.base.config import Config
    from shardwise.cli.plan import parallel_table

    return Config.from_dict({
        "model": L.MODELS[model], "parallel": parallel_table(lay),
        "optimizer": {"warmup_steps": 2},
        "training": {"steps": steps, "global_batch_size": L.BATCH, "eval_every": 0,
                     "progress": False, "sample_chars": 0, "precision": "fp32",
                     "out_dir": "/tmp/shardwise-planner-local"},
        "checkpoint": {"at_end": False}}).model_dump()


def measure(model: str, ws: int, lays: list, steps: int, warmup: int, passes: int) -> list:
    """Per layout of ``lays``: the step time (the slowest rank of each step; the fastest of
    the quiet steps), the quiet steps counted and the least foreign load seen. Each layout
    trains in a spawn of its own, as ``shardwise train`` runs it, ``passes`` times, the
    layouts in turn: ranks that also hold the other layouts' process groups ran a
    pipeline's steps 13-23% slower (``benchmarks/local_probe.py``), and a burst of load
    that slows one spawn seldom slows the next."""
    from shardwise.comm.quiet import THRESHOLD
    from shardwise.launch import spawn

    total = warmup + 2 * steps + 3
    got = [[] for _ in lays]  # per layout, per pass: the ranks' results
    for _ in range(passes):
        for i, lay in enumerate(lays):
            # its ranks outnumber the cores on purpose: no warning that they do
            got[i].append(spawn(quiet_worker, ws, ([config(model, lay, total)], warmup, steps,
                                                   1), warn_shared_cores=False))
    rows = []
    for runs in got:
        per_step, loads = [], []
        for res in runs:
            n = len(res[0][0]["times"])
            per_step += [max(r[0]["times"][k] for r in res) for k in range(n)]
            loads += res[0][0]["loads"]
        quiet = [t for t, x in zip(per_step, loads) if x < THRESHOLD]
        rows.append({"step": min(quiet or per_step), "quiet_steps": len(quiet),
                     "foreign_cores": min(loads), "steps": per_step})
    return rows


def spec_of(model: str, vocab: int):
    """The planner's spec of ``model`` (``ModelSpec.from_section``, as ``plan --config``
    reads a TOML), at the character tokenizer's vocabulary."""
    from shardwise.base.config import Config
    from shardwise.planner.specs import ModelSpec

    cfg = Config.from_dict({"model": L.MODELS[model]})
    return replace(ModelSpec.from_section(cfg.model, model), vocab_size=vocab)


def choose(ranked: list, top: int, spread: int) -> list[int]:
    """Indices into the planner's ranking: its ``top`` best and ``spread`` more spaced
    evenly over the rest, the last one included."""
    n = len(ranked)
    picks = list(range(min(top, n)))
    rest = n - len(picks)
    if rest > 0 and spread > 0:
        k = min(spread, rest)
        picks += sorted({len(picks) + round((j + 1) * (rest - 1) / k) for j in range(k)})
    return sorted(set(picks))


def one_size(model: str, ws: int, vocab: int, a) -> tuple[list, dict]:
    """Calibrate, rank, train and compare one model at one world size."""
    from shardwise.planner.hardware import local_cluster
    from shardwise.planner.search import plan

    load0, t0 = os.getloadavg()[0], time.perf_counter()
    spec = spec_of(model, vocab)
    cluster = local_cluster(spec.n_embd, spec.block_size, spec.n_head, ws, spec=spec)
    feasible, _ = plan(spec, cluster, ws, L.BATCH, precision="fp32",
                       memory_limit=cluster.memory_per_rank(ws), top=a.top)
    picks = choose(feasible, a.top, a.spread)
    lays = [feasible[i].layout for i in picks]
    t_plan = time.perf_counter() - t0
    meas = measure(model, ws, lays, a.steps, a.warmup, a.passes)
    rows = []
    for i, lay, m in zip(picks, lays, meas):
        pred = feasible[i].time
        rows.append({"model": model, "ws": ws, "label": lay.label(), "planner_rank": i + 1,
                     **{f"pred_{k}": v for k, v in pred.items()},
                     "measured_step": m["step"], "quiet_steps": m["quiet_steps"],
                     "foreign_cores": m["foreign_cores"], "steps": m["steps"],
                     "error": pred["step"] / m["step"] - 1})
    meta = {"calibration": cluster.meta, "ranked": len(feasible), "load_before": load0,
            "load_after": os.getloadavg()[0], "plan_s": t_plan,
            "wall_s": time.perf_counter() - t0}
    return rows, meta


def summarise(rows: list) -> dict:
    """Median and worst |error|, Spearman's rho, and where the measured-fastest layout sits
    in the planner's ranking of those trained: 1 + the layouts it predicts strictly faster
    (layouts it prices the same, such as ZeRO-1 and -2 or the two cuts of a pipeline that
    split the layers alike, share a rank: which of them measures fastest is noise)."""
    errs = [abs(r["error"]) for r in rows]
    by_pred = sorted(rows, key=lambda r: r["pred_step"])
    fastest = min(rows, key=lambda r: r["measured_step"])
    rank = 1 + sum(r["pred_step"] < fastest["pred_step"] * (1 - 1e-9) for r in rows)
    ties = sum(r["pred_step"] == fastest["pred_step"] for r in rows) - 1
    return {"median_abs_error": statistics.median(errs), "worst_abs_error": max(errs),
            "fastest_ties": ties,
            "spearman": spearman([r["pred_step"] for r in rows],
                                 [r["measured_step"] for r in rows]),
            "first_choice": by_pred[0]["label"], "fastest_measured": fastest["label"],
            # what taking the planner's first choice costs against the measured-fastest
            "first_choice_slower": by_pred[0]["measured_step"] / fastest["measured_step"] - 1,
            "fastest_planner_rank": rank, "fastest_in_top_two": rank <= 2,
            "layouts": len(rows)}


BAR = {"median_abs_error": 0.15, "worst_abs_error": 0.40, "spearman": 0.8}


def meets(s: dict) -> bool:
    """Whether one model and world size meets issue 44's bar."""
    return (s["median_abs_error"] <= BAR["median_abs_error"]
            and s["worst_abs_error"] <= BAR["worst_abs_error"]
            and s["spearman"] >= BAR["spearman"] and s["fastest_in_top_two"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", choices=sorted(L.MODELS), default=["gpt", "llama"])
    ap.add_argument("--world-size", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--top", type=int, default=4, help="the planner's best layouts to train")
    ap.add_argument("--spread", type=int, default=4,
                    help="more layouts, spaced evenly down the rest of its ranking")
    ap.add_argument("--steps", type=int, default=3, help="quiet steps per pass")
    ap.add_argument("--passes", type=int, default=3, help="spawns of each layout, in turn")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps per layout first (the allocator, the caches)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "planner_results"))
    a = ap.parse_args()
    import torch

    from shardwise.data import CharTokenizer, load_text

    t_start = time.perf_counter()
    vocab = CharTokenizer.from_text(load_text(None)).vocab_size
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    rows, summary = [], {}
    for model in a.model:
        for ws in a.world_size:
            rs, meta = one_size(model, ws, vocab, a)
            rows += rs
            summary[f"{model} ws{ws}"] = {**summarise(rs), **meta}
    wall = time.perf_counter() - t_start
    lines = [f"{', '.join(a.model)} of benchmarks/layouts.py (4 x 128, context 64, global "
             f"batch {L.BATCH}); {os.cpu_count()} cores, gloo, 1 thread per rank, torch "
             f"{torch.__version__}; the planner's top {a.top} and {a.spread} more down its "
             f"ranking; fastest of {a.steps} quiet steps per pass, {a.passes} passes, after "
             f"{a.warmup}; load average (1, 5, 15 min) before "
             f"{', '.join(f'{x:.2f}' for x in load0)}, after "
             f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}; {wall:.0f} s in all"]
    for key, s in summary.items():
        rs = [r for r in rows if f"{r['model']} ws{r['ws']}" == key]
        lines += ["", f"{key}: {s['ranked']} layouts ranked; load average before "
                  f"{s['load_before']:.2f}, after {s['load_after']:.2f}; {s['wall_s']:.0f} s; "
                  f"calibration {json.dumps(_short(s['calibration']))}",
                  f"{'rank':>4} {'layout':<36} {'measured ms':>11} {'predicted ms':>12} "
                  f"{'error':>7} {'quiet':>5}"]
        for r in sorted(rs, key=lambda r: r["measured_step"]):
            lines.append(f"{r['planner_rank']:>4} {r['label']:<36} "
                         f"{r['measured_step'] * 1e3:>11.1f} {r['pred_step'] * 1e3:>12.1f} "
                         f"{r['error']:>+7.0%} {r['quiet_steps']:>5}")
        lines.append(f"median |error| {s['median_abs_error']:.0%}, worst "
                     f"{s['worst_abs_error']:.0%}, Spearman {s['spearman']:.2f}; fastest "
                     f"measured {s['fastest_measured']} is the planner's no. "
                     f"{s['fastest_planner_rank']} of those trained"
                     + (f" (tied with {s['fastest_ties']})" if s["fastest_ties"] else "")
                     + f" (first choice {s['first_choice']}, measured "
                     f"{s['first_choice_slower']:.1%} slower); "
                     f"{'meets' if meets(s) else 'does NOT meet'} the "
                     "bar (median <= 15%, worst <= 40%, rho >= 0.8, fastest in the top two)")
    (out / "planner_local.json").write_text(json.dumps({"rows": rows, "summary": summary,
                                                        "load_before": load0,
                                                        "wall_s": wall}, indent=1))
    (out / "planner_local.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(rows, list(summary), out / "planner_local.png", lines[0])


def _short(cal: dict) -> dict:
    """The calibration, rounded for the table."""
    return {k: ([[g, round(w * 1e3, 2), round(s * 1e3, 3)] for g, w, s in v]
                if k == "sync_s" else float(f"{v:.4g}")) for k, v in cal.items()}


def _plot(rows, keys, path, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    for key, marker in zip(keys, "os^vD<>"):
        rs = [r for r in rows if f"{r['model']} ws{r['ws']}" == key]
        ax.scatter([r["measured_step"] * 1e3 for r in rs], [r["pred_step"] * 1e3 for r in rs],
                   marker=marker, label=key)
    lo = min(min(r["measured_step"], r["pred_step"]) for r in rows) * 1e3 * 0.8
    hi = max(max(r["measured_step"], r["pred_step"]) for r in rows) * 1e3 * 1.2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
    ax.plot([lo, hi], [lo * 1.15, hi * 1.15], "k:", lw=0.6, label="+-15%")
    ax.plot([lo, hi], [lo / 1.15, hi / 1.15], "k:", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
