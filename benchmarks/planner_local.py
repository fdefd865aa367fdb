"""Planner vs measurement on this machine: every feasible layout of one GPT at world size
4 and 8, predicted step time (``shardwise.planner``, calibrated now: a block's FLOP/s and
overhead, the comm profile, the wait of a synchronisation when ranks outnumber cores) beside
the measured one (the layouts of ``benchmarks/layouts.py``: dp x tp x pp with ZeRO 0, 1, 3
and m = 2 pp micro-batches, same GPT 4 x 128, context 64, global batch 16, trained on
Shakespeare by local gloo ranks with one thread each).

Measured step time: the fastest step among those no other process disturbed (foreign CPU
below 0.15 cores, ``comm.quiet``; the fastest of all when fewer were quiet, flagged in the
table): on a shared 2-core machine other work only ever adds time.
Reports per layout the error (predicted / measured - 1), the median and worst absolute
error, Spearman's rank correlation of predicted and measured step times, and whether the
planner's first choice is within 10% of the fastest measured layout. Writes
``OUT/planner_local.json``, ``OUT/planner_local.txt`` and a scatter ``OUT/planner_local.png``.

    python benchmarks/planner_local.py --steps 3 --warmup 1 --out benchmarks/planner_results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import layouts as L  # noqa: E402  (the measured side: one spawn per world size)


def spearman(x: list[float], y: list[float]) -> float:
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
    return num / den


def quiet_worker(configs: list[dict], warmup: int, steps: int) -> list[dict]:
    """Each layout: ``warmup`` untimed steps, then timed steps until ``steps`` of them saw
    no foreign load (``comm.quiet``; at most 3 x ``steps``). Per step, every rank's time."""
    import time

    import torch

    from shardwise import comm
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.base.config import Config
    from shardwise.comm import quiet

    torch.set_num_threads(1)
    import torch.distributed as dist

    pids = quiet.rank_pids()  # collective: every rank
    foreign = quiet.Foreign(pids) if dist.get_rank() == 0 else None
    out = []
    for c in configs:
        trainer = build_trainer(Config.from_dict(c))
        for _ in range(warmup):
            trainer.train_step()
        times: list[float] = []

        def one(i: int) -> None:
            comm.barrier()  # every rank starts the step together
            t0 = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - t0)

        loads = quiet.repeat_until_quiet(one, steps, 3 * steps, foreign)
        out.append({"times": times, "loads": loads})
    return out


def measure(ws: int, steps: int, warmup: int) -> list[dict]:
    """Per layout of ``layouts.layouts(ws)``: the step time (the slowest rank of each step;
    the fastest of the quiet steps: other processes only ever add time) and the foreign
    load of the steps kept."""
    from shardwise.comm.quiet import THRESHOLD
    from shardwise.launch import spawn

    lays = L.layouts(ws)
    configs = [L._config(lay, warmup + 3 * steps) for lay in lays]
    res = spawn(quiet_worker, ws, (configs, warmup, steps))
    rows = []
    for i in range(len(lays)):
        per_step = [max(r[i]["times"][k] for r in res) for k in range(len(res[0][i]["times"]))]
        loads = res[0][i]["loads"]
        quiet = [t for t, x in zip(per_step, loads) if x < THRESHOLD]
        rows.append({"step": min(quiet or per_step), "quiet_steps": len(quiet),
                     "foreign_cores": min(loads), "steps": per_step})
    return rows


def predict(ws: int, vocab: int) -> tuple[list[dict], dict]:
    from shardwise.planner.hardware import local_cluster
    from shardwise.planner.simulate import Layout, simulate
    from shardwise.planner.specs import ModelSpec

    m = L.MODEL
    spec = ModelSpec("bench", m["n_layer"], m["n_embd"], m["n_head"], vocab, m["block_size"],
                     m["tie_weights"])
    cluster = local_cluster(m["n_embd"], m["block_size"], m["n_head"], ws)
    out = []
    for lay in L.layouts(ws):
        mb = L.BATCH // lay["dp"] // lay["micro_batches"]
        lo = Layout(lay["dp"], lay["tp"], lay["pp"], mb, lay["micro_batches"], "1f1b", 1,
                    lay["zero"])
        out.append({**lay, "label": lo.label(), **{f"pred_{k}": v for k, v in
                                                    simulate(spec, lo, cluster, "fp32").items()}})
    return out, cluster.meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "planner_results"))
    a = ap.parse_args()
    from shardwise.data import CharTokenizer, load_text

    vocab = CharTokenizer.from_text(load_text(None)).vocab_size
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    rows, meta = [], {}
    for ws in a.world_size:
        pred, meta[ws] = predict(ws, vocab)      # calibrate, then measure, back to back
        meas = measure(ws, a.steps, a.warmup)
        for p, m in zip(pred, meas):
            step = m["step"]
            rows.append({**p, "ws": ws, "measured_step": step, "quiet_steps": m["quiet_steps"],
                         "foreign_cores": m["foreign_cores"], "error": p["pred_step"] / step - 1})
    lines = [f"GPT {L.MODEL['n_layer']} x {L.MODEL['n_embd']}, context {L.MODEL['block_size']}, "
             f"global batch {L.BATCH}; {os.cpu_count()} cores, gloo, 1 thread per rank; "
             f"fastest of {a.steps} quiet steps (of at most {3 * a.steps}) after {a.warmup}; load average before {load0:.2f}, "
             f"after {os.getloadavg()[0]:.2f}"]
    summary = {}
    for ws in a.world_size:
        rs = [r for r in rows if r["ws"] == ws]
        errs = [abs(r["error"]) for r in rs]
        rho = spearman([r["pred_step"] for r in rs], [r["measured_step"] for r in rs])
        first = min(rs, key=lambda r: r["pred_step"])
        fastest = min(rs, key=lambda r: r["measured_step"])
        within = first["measured_step"] <= 1.10 * fastest["measured_step"]
        summary[ws] = {"median_abs_error": statistics.median(errs), "worst_abs_error": max(errs),
                       "spearman": rho, "first_choice": first["label"],
                       "fastest_measured": fastest["label"], "first_within_10pct": within,
                       "calibration": meta[ws]}
        lines += ["", f"world size {ws}: calibration {json.dumps(meta[ws])}",
                  f"{'layout':<32} {'measured ms':>11} {'predicted ms':>12} {'error':>7} "
                  f"{'quiet steps':>11}"]
        for r in sorted(rs, key=lambda r: r["measured_step"]):
            lines.append(f"{r['label']:<32} {r['measured_step'] * 1e3:>11.1f} "
                         f"{r['pred_step'] * 1e3:>12.1f} {r['error']:>+7.0%} "
                         f"{r['quiet_steps']:>11}")
        lines.append(f"median |error| {summary[ws]['median_abs_error']:.0%}, worst "
                     f"{summary[ws]['worst_abs_error']:.0%}, Spearman {rho:.2f}; first choice "
                     f"{first['label']} ({first['measured_step'] * 1e3:.1f} ms measured) vs "
                     f"fastest {fastest['label']} ({fastest['measured_step'] * 1e3:.1f} ms): "
                     f"{'within' if within else 'NOT within'} 10%")
    (out / "planner_local.json").write_text(json.dumps({"rows": rows, "summary": summary},
                                                       indent=1))
    (out / "planner_local.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(rows, a.world_size, out / "planner_local.png", lines[0])


def _plot(rows, sizes, path, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    for ws, marker in zip(sizes, "os^"):
        rs = [r for r in rows if r["ws"] == ws]
        ax.scatter([r["measured_step"] * 1e3 for r in rs], [r["pred_step"] * 1e3 for r in rs],
                   marker=marker, label=f"world size {ws}")
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
    ax.set_title(title, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
