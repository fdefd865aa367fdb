"""Parameter server benchmarks: bytes through the busiest node, and stragglers.

    python benchmarks/param_server.py bytes        # W = 2, 4, 8 and S = 1, 2; table on stdout
    python benchmarks/param_server.py straggler    # BSP, SSP s=1,2,4, ASP; one worker 3x slower
    python benchmarks/param_server.py delay        # one process, gradients d steps stale
    python benchmarks/param_server.py report --target 3.2   # tables of the saved straggler runs
    python benchmarks/param_server.py converge --steps 400  # BSP vs SSP s=2 vs ASP, final loss

``bytes``: a BSP job of a few steps with ``shardwise.comm``'s byte counters on, then one ring
all-reduce of the same gradient over the W workers (our ``ring`` algorithm, counted the same
way). Per-step bytes (sent + received) of the busiest server, against those of the busiest
rank of the ring. Seed 003's table: peak node bandwidth O(N) for a parameter server, O(1)
for a ring all-reduce (N = number of workers).

``straggler``: loss against wall-clock and against clocks for our all-reduce DDP and for each
consistency with worker
W-1 slowed FACTOR x, then with one worker drawn at random per clock slowed FACTOR x
(``ps.slow_worker``); writes ``benchmarks/ps_results/straggler_{fixed,random}.{json,png}``
and prints the tables (time and clocks to reach a validation loss).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "ps_results"


def _cfg(corpus: str | None, servers: int, workers: int, consistency: str, staleness, steps: int,
         model: dict, batch: int, out: str, slow: str | None = None, eval_every: int = 0,
         lr: float = 3e-3) -> dict:
    from shardwise.base.config import Config

    return Config.from_dict({
        "model": model, "data": {"path": corpus}, "parallel": {"mode": "ps"},
        "ps": {"servers": servers, "workers": workers, "consistency": consistency,
               "staleness": staleness, "slow_worker": slow},
        "optimizer": {"lr": lr, "warmup_steps": 10, "grad_clip": 0.0, "min_lr": lr / 10},
        "training": {"steps": steps, "global_batch_size": batch, "eval_every": eval_every,
                     "eval_batches": 2, "log_every": 10 ** 6, "out_dir": out,
                     "sample_chars": 0, "progress": False},
        "checkpoint": {"every": 0, "at_end": False}}).model_dump()


def _small_corpus() -> str:
    """The tests' corpus (``tests/conftest.py``): 120,000 characters of real Shakespeare."""
    import tempfile

    from shardwise.data import shakespeare_files

    text = "".join(f.read_text(encoding="utf-8") for f in shakespeare_files()[:1])[:120_000]
    path = Path(tempfile.gettempdir()) / "shardwise_ps_bench_corpus.txt"
    path.write_text(text, encoding="utf-8")
    return str(path)


# -- bytes ------------------------------------------------------------------------------------

def bytes_rank(cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    from shardwise import comm
    from shardwise.apps.param_server import train_rank
    from shardwise.comm import accounting

    S, W = cfg["ps"]["servers"], cfg["ps"]["workers"]
    steps = cfg["training"]["steps"]
    accounting.enable()
    res = train_rank(cfg)
    ps_records = accounting.table()
    accounting.disable()
    group = dist.new_group(list(range(S, S + W)))
    n = torch.tensor([sum(p.numel() for p in res["params"].values()) if "params" in res else 0])
    comm.broadcast(n, S)  # worker 0 knows the model size (after the measured part)
    out = {"role": res["role"], "numel": int(n)}
    if res["role"] == "server":
        lo, hi = res["bounds"]
        final = (hi - lo) * 4 + 32  # the FINAL reply to worker 0 is not part of a step
        total = sum(r["bytes_sent"] + r["bytes_recv"] for r in ps_records)
        out["per_step"] = (total - final) / steps
    else:
        grad = torch.zeros(int(n))
        with accounting.recording() as rec:
            comm.all_reduce(grad, group=group, algorithm="ring")
        out["ring"] = sum(r.bytes_sent + r.bytes_recv for r in rec.records
                          if r.collective != "check")
    comm.barrier()
    return out


def run_bytes(args) -> int:
    from shardwise.launch import spawn

    model = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32}
    rows = []
    for W in (2, 4, 8):
        for S in (1, 2):
            cfg = _cfg(args.data, S, W, "bsp", None, args.steps, model, 8 * W, "/tmp/ps_bytes")
            res = spawn(bytes_rank, S + W, (cfg,), threads=1)
            X = res[0]["numel"] * 4
            server = max(r["per_step"] for r in res if r["role"] == "server")
            ring = max(r["ring"] for r in res if r["role"] == "worker")
            rows.append({"workers": W, "servers": S, "gradient_bytes": X,
                         "busiest_server_bytes": server, "server_over_X": server / X,
                         "formula_server_over_X": 2 * W / S,
                         "busiest_ring_rank_bytes": ring, "ring_over_X": ring / X,
                         "formula_ring_over_X": 4 * (W - 1) / W})
            print(json.dumps(rows[-1]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bytes.json").write_text(json.dumps(rows, indent=1))
    print(f"\nper-step bytes (sent + received), X = {rows[0]['gradient_bytes']:,} gradient bytes; "
          f"{args.steps} BSP steps, gloo on 127.0.0.1")
    print("| W | S | busiest server / X | formula 2W/S | busiest ring rank / X | "
          "formula 4(W-1)/W |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['servers']} | {r['server_over_X']:.3f} | "
              f"{r['formula_server_over_X']:.3f} | {r['ring_over_X']:.3f} | "
              f"{r['formula_ring_over_X']:.3f} |")
    return 0


# -- stragglers -------------------------------------------------------------------------------

MODES = (("bsp", None), ("ssp", 1), ("ssp", 2), ("ssp", 4), ("asp", None))


def straggler_rank(cfgs: list[dict]) -> list[dict]:
    from shardwise import comm
    from shardwise.apps.param_server import train_rank

    out = []
    for cfg in cfgs:
        res = train_rank(cfg)
        out.append({k: res[k] for k in ("evals", "losses", "times") if k in res}
                   | {"role": res["role"], "updates": res.get("updates")})
        comm.barrier()
    return out


def ddp_rank(cfg_dict: dict) -> dict:
    """Our all-reduce DDP on the same model, batches, AdamW and schedule, W ranks, with the
    same straggler: a slow rank sleeps (factor - 1) x its compute time before its forward
    (the all-reduce inside backward then waits for it). The compute time is one forward +
    backward under ``no_sync`` timed before training, since a step's own time includes
    waiting for the others and would compound."""
    import torch
    import torch.distributed as dist

    from shardwise.apps.param_server.optim import lr_at, make_optimizer
    from shardwise.apps.param_server.training import _data_and_model, evaluate, straggle
    from shardwise.base.config import Config
    from shardwise.data import DistributedBatchSampler
    from shardwise.parallel.data_parallel import DistributedDataParallel

    cfg = Config.from_dict(cfg_dict)
    rank, W, t = dist.get_rank(), dist.get_world_size(), cfg.training
    cpu = torch.device("cpu")
    train, val, model = _data_and_model(cfg, cpu)
    ddp = DistributedDataParallel(model)
    opt = make_optimizer("adamw", list(model.parameters()), cfg.optimizer)
    sampler = DistributedBatchSampler(train, cfg.model.block_size, t.global_batch_size, rank, W,
                                      seed=t.seed)
    slow, evals = cfg.ps.slow(), []
    t0 = time.perf_counter()
    with ddp.no_sync():
        x, y = sampler.windows(torch.arange(t.global_batch_size // W))
        ddp(x, y)[1].backward()
    compute = time.perf_counter() - t0
    started = time.perf_counter()
    for step in range(t.steps):
        if rank == 0 and step % t.eval_every == 0:
            evals.append((step, time.perf_counter() - started, evaluate(model, val, cfg, cpu)))
        factor = straggle(slow, rank, step, W, t.seed)
        if factor > 1.0:
            time.sleep((factor - 1.0) * compute)
        x, y = sampler.next_batch()
        ddp.zero_grad()
        ddp(x, y)[1].backward()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.optimizer, t.steps)
        opt.step()
    if rank == 0:
        evals.append((t.steps, time.perf_counter() - started, evaluate(model, val, cfg, cpu)))
    return {"evals": evals, "seconds": time.perf_counter() - started}


def run_straggler(args) -> int:
    import os

    from shardwise.launch import spawn

    S, W = 1, args.workers
    model = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64}
    RESULTS.mkdir(exist_ok=True)
    scenarios = (("fixed", f"{W - 1}:{args.factor:g}"), ("random", f"random:{args.factor:g}"))
    for name, slow in scenarios:
        cfgs = [_cfg(args.data, S, W, c, s, args.steps, model, 8 * W, "/tmp/ps_straggler",
                     slow, eval_every=args.eval_every) for c, s in MODES]
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        res = spawn(straggler_rank, S + W, (cfgs,), threads=1)
        wall = time.perf_counter() - t0
        ddp = spawn(ddp_rank, W, (cfgs[0],), threads=1)[0]
        runs = [{"mode": "our DDP (all-reduce)", "evals": ddp["evals"], "updates": args.steps,
                 "worker0_s": ddp["seconds"]}]
        for i, (c, s) in enumerate(MODES):
            w0 = res[S][i]
            runs.append({"mode": c if s is None else f"{c} s={s}", "evals": w0["evals"],
                         "updates": res[0][i]["updates"], "worker0_s": w0["times"][-1]})
        meta = {"workers": W, "servers": S, "slow_worker": slow, "steps": args.steps,
                "model": model, "global_batch": 8 * W, "threads_per_rank": 1, "wall_s": wall,
                "load_before": load, "cores": os.cpu_count()}
        (RESULTS / f"straggler_{name}.json").write_text(
            json.dumps({"meta": meta, "runs": runs}, indent=1))
        _plot(runs, meta, RESULTS / f"straggler_{name}.png")
        _table(runs, meta, args)
    return 0


def _table(runs: list[dict], meta: dict, args) -> None:
    target, W = args.target, meta["workers"]
    who = (f"worker {W - 1}" if not meta["slow_worker"].startswith("random")
           else "one random worker per clock")
    print(f"\nS={meta['servers']}, W={W}, {who} {args.factor:g}x slower, {args.steps} clocks, "
          f"1 thread per rank, load average {meta['load_before']:.1f} before; validation loss "
          f"by worker 0 every {args.eval_every} clocks")
    print(f"| mode | server updates | final val loss | s to val loss <= {target} | "
          f"worker-0 clocks to it | worker 0 wall s |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        hit = next(((c, t) for c, t, v in r["evals"] if v <= target), None)
        print(f"| {r['mode']} | {r['updates']} | {r['evals'][-1][2]:.3f} | "
              f"{'-' if hit is None else f'{hit[1]:.1f}'} | {'-' if hit is None else hit[0]} | "
              f"{r['worker0_s']:.1f} |")


def _plot(runs: list[dict], meta: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=110, sharey=True)
    for r in runs:
        c, t, v = zip(*r["evals"])
        a.plot(t, v, "-", label=r["mode"])
        b.plot(c, v, "-", label=r["mode"])
    a.set_xlabel("wall-clock (s)")
    b.set_xlabel("worker 0's clock")
    a.set_ylabel("validation loss (nats / char)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    b.legend()
    fig.suptitle(f"parameter server, S={meta['servers']}, W={meta['workers']}, slow worker "
                 f"{meta['slow_worker'].replace(':', ' x')} (GPT on Shakespeare, CPU, 1 thread "
                 "per rank)")
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def run_converge(args) -> int:
    """Final validation loss of BSP, SSP s=2 and ASP without a straggler (S=1, W=2)."""
    from shardwise.launch import spawn

    S, W = 1, 2
    model = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64}
    modes = (("bsp", None), ("ssp", 2), ("asp", None))
    cfgs = [_cfg(args.data, S, W, c, s, args.steps, model, 8 * W, "/tmp/ps_converge",
                 lr=args.lr) for c, s in modes]
    res = spawn(straggler_rank, S + W, (cfgs,), threads=1)
    bsp = res[S][0]["evals"][-1][2]
    print(f"S={S}, W={W}, {args.steps} clocks, lr {args.lr:g}, no straggler")
    print("| mode | server updates | final val loss | vs BSP |\n|---|---|---|---|")
    for i, (c, s) in enumerate(modes):
        v = res[S][i]["evals"][-1][2]
        print(f"| {c if s is None else f'{c} s={s}'} | {res[0][i]['updates']} | {v:.3f} | "
              f"{100 * (v / bsp - 1):+.1f}% |")
    return 0


def run_report(args) -> int:
    """Tables of the saved straggler runs for another ``--target`` (no training)."""
    for name in ("fixed", "random"):
        data = json.loads((RESULTS / f"straggler_{name}.json").read_text())
        args.factor = float(data["meta"]["slow_worker"].split(":")[1])
        args.steps, args.eval_every = data["meta"]["steps"], 10
        _table(data["runs"], data["meta"], args)
    return 0


# -- staleness alone, in one process ------------------------------------------------------------

def run_delay(args) -> int:
    """One process, the straggler benchmark's model and batches, every gradient computed on
    the weights of ``d`` steps ago (d = 0: plain training = BSP): what staleness alone costs,
    with no timing in play."""
    import torch

    from shardwise.apps.param_server.optim import lr_at, make_optimizer
    from shardwise.apps.param_server.training import _data_and_model, evaluate
    from shardwise.base.config import Config
    from shardwise.data import DistributedBatchSampler

    torch.set_num_threads(1)
    model_cfg = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64}
    W = args.workers
    cfg = Config.from_dict(_cfg(args.data, 1, W, "bsp", None, args.steps, model_cfg, 8 * W,
                                "/tmp/ps_delay"))
    print(f"one process, {args.steps} steps, global batch {8 * W}; gradient of step k taken "
          "at the weights after step k - 1 - d")
    print("| delay d | final validation loss |\n|---|---|")
    for delay in (0, 1, 2, 4):
        train, val, model = _data_and_model(cfg, torch.device("cpu"))
        params = list(model.parameters())
        opt = make_optimizer("adamw", params, cfg.optimizer)
        sampler = DistributedBatchSampler(train, model_cfg["block_size"], 8 * W, 0, 1,
                                          seed=cfg.training.seed)
        history = [[p.detach().clone() for p in params]]
        for step in range(args.steps):
            now = [p.detach().clone() for p in params]
            with torch.no_grad():
                for p, old in zip(params, history[max(0, len(history) - 1 - delay)]):
                    p.copy_(old)
            x, y = sampler.next_batch()
            opt.zero_grad()
            model(x, y)[1].backward()
            with torch.no_grad():
                for p, cur in zip(params, now):
                    p.copy_(cur)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg.optimizer, args.steps)
            opt.step()
            history = (history + [[p.detach().clone() for p in params]])[-(delay + 1):]
        print(f"| {delay} | {evaluate(model, val, cfg, torch.device('cpu')):.3f} |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("bytes", "straggler", "delay", "report", "converge"))
    ap.add_argument("--data", default=None, help="text file (default: the first 120,000 "
                    "characters of the Shakespeare package's first text, as the tests use)")
    ap.add_argument("--steps", type=int, default=None, help="bytes: 3; straggler: 150")
    ap.add_argument("--workers", type=int, default=3, help="straggler: W")
    ap.add_argument("--factor", type=float, default=3.0, help="straggler: slowdown of worker W-1")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-3, help="converge: peak learning rate")
    ap.add_argument("--target", type=float, default=3.0, help="validation loss to reach")
    args = ap.parse_args(argv)
    args.data = args.data or _small_corpus()
    args.steps = args.steps or (3 if args.what == "bytes" else 150)
    return {"bytes": run_bytes, "straggler": run_straggler, "delay": run_delay,
            "report": run_report, "converge": run_converge}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
