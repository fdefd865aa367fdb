"""``shardwise bench comm``: all-reduce bandwidth, the seeds' comparison table, calibration.

    shardwise bench comm                      # sweep 4 KiB..64 MiB at N = 2 and 4, plot
    shardwise bench comm --table              # steps / peak / total bytes at N = 2, 4, 8
    shardwise bench comm --calibrate          # measure alpha, beta, gamma -> profiles/
    python benchmarks/comm_bench.py ...       # the same

Sweep: for each size, every algorithm runs once per repeat in an order rotated from one
repeat to the next (so drift hits all alike); a repeat times ``inner`` back-to-back calls
started by a barrier, each rank times itself and the slowest rank counts. Each world size
is spawned ``--spawns`` times (3) and the repeats pooled: where the scheduler puts the
ranks (two communicating ranks on one core or on two) is decided per spawn and changes a
one-way step by up to 2x at N = 4 here. Repeats during
which other processes used the CPUs are dropped and run again (``comm/quiet.py``: up to 3x
``--repeats`` tries; if fewer than 3 were quiet, all count); the median over the quiet
repeats is reported as bus bandwidth, busbw = X / t * 2 (N-1) / N (the nccl-tests
convention: the link rate an all-reduce needs), beside the cost model's prediction from the
active profile. The argument check (``configure(check=...)``) is off during the sweep so
the algorithms themselves are timed; ``--check`` turns it on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.base.files import save_figure, write_text
from shardwise.cli import comm_table as table_mod
from shardwise.cli.common import EXIT_USAGE, Parser, parse_or_code
from shardwise.comm import cost

ALGORITHMS = ("native", "ring", "halving_doubling", "tree", "naive", "sequential", "parallel",
              "shm", "hierarchical")
DEFAULT_ALGORITHMS = ALGORITHMS[:7]
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"


class BenchError(ValueError):
    """Bad command-line input: printed as one line, exit code 2."""


def parse_size(text: str) -> int:
    """Bytes of a ``--sizes`` entry (``4K``, ``1M``, ``64MiB``: binary units). Raises BenchError
    unless it reads as a positive multiple of 4 bytes (whole float32 elements)."""
    units = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
             "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    try:
        value = int(float(num) * units[t[len(num):]])
    except (ValueError, KeyError):
        raise BenchError(f"--sizes: cannot read size {text!r} (use e.g. 4K, 1M, 64M)") from None
    if value < 4 or value % 4:
        raise BenchError(f"--sizes: {text!r} must be a positive multiple of 4 bytes (float32)")
    return value


def sweep_worker(sizes: list[int], algorithms: list[str], repeats: int, check: bool,
                 fake_hosts: int = 0) -> dict:
    """Per rank: {algorithm: {size: [seconds per call, one per repeat]}} and, per size, the
    foreign load of each repeat (``quiet.py``; the same list on every rank). ``fake_hosts``
    > 0: ranks r are told they live on host r // fake_hosts (``$SHARDWISE_HOST_ID``), for
    the hierarchical all-reduce on one machine."""
    from shardwise import comm
    from shardwise.comm import quiet
    if fake_hosts:
        os.environ["SHARDWISE_HOST_ID"] = f"bench-host-{dist.get_rank() // fake_hosts}"
    comm.configure(check=check)
    pids = quiet.rank_pids()  # collective: every rank
    foreign = quiet.Foreign(pids) if dist.get_rank() == 0 else None
    out: dict = {a: {} for a in algorithms}
    out["_foreign"] = {}
    for m in sizes:
        x = torch.ones(m // 4)
        inner = max(1, min(20, (2 << 20) // m))
        for a in algorithms:  # warm-up: buffers, connections, caches
            comm.all_reduce(x, algorithm=a)
            out[a][m] = []

        def one_repeat(rep: int) -> None:
            k = rep % len(algorithms)
            for a in algorithms[k:] + algorithms[:k]:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(inner):
                    comm.all_reduce(x, algorithm=a)
                out[a][m].append((time.perf_counter() - t0) / inner)
                x.fill_(1.0)  # keep the values finite whatever the repeats

        out["_foreign"][m] = quiet.repeat_until_quiet(one_repeat, repeats, 3 * repeats, foreign)
    return out


def run_sweep(world_sizes: list[int], sizes: list[int], algorithms: list[str], repeats: int,
              threads: int | None, check: bool, spawns: int = 3,
              fake_hosts: int = 0) -> list[dict]:
    """``spawns`` fresh sets of ranks per world size (the scheduler places ranks per spawn),
    their quiet repeats pooled."""
    from shardwise.comm import quiet
    from shardwise.launch import spawn, threads_per_rank
    rows = []
    prof = cost.active_profile()
    for n in world_sizes:
        hosts_of = fake_hosts if fake_hosts and n % fake_hosts == 0 and n > fake_hosts else 0
        algos = [a for a in algorithms if a != "hierarchical" or hosts_of]
        runs = [spawn(sweep_worker, n, (sizes, algos, repeats, check, hosts_of),
                      threads=threads) for _ in range(spawns)]
        prm = prof.params(n)
        for a in algos:
            for m in sizes:
                loads = [x for per_rank in runs for x in per_rank[0]["_foreign"][m]]
                every = [max(pr[a][m][i] for pr in per_rank) for per_rank in runs
                         for i in range(len(per_rank[0]["_foreign"][m]))]
                reps = quiet.quiet_values(every, loads)
                t = statistics.median(reps)
                pred = (cost.predict_hierarchical(n, n // hosts_of, m, prof)
                        if a == "hierarchical" else cost.predict(a, n, m, prm))
                rows.append({"world_size": n, "threads_per_rank": threads or threads_per_rank(n),
                             "algorithm": a, "bytes": m, "median_s": t,
                             "busbw_GBps": m / t * 2 * (n - 1) / n / 1e9,
                             "predicted_s": pred, "model_error": (pred - t) / t,
                             "repeats_s": reps, "tries": len(loads),
                             "quiet_repeats": sum(x < quiet.THRESHOLD for x in loads)})
    return rows


def format_sweep(rows: list[dict]) -> str:
    """Text tables of a sweep: busbw [prediction, time error] per size and algorithm."""
    lines = []
    for n in sorted({r["world_size"] for r in rows}):
        sub = [r for r in rows if r["world_size"] == n]
        algos = list(dict.fromkeys(r["algorithm"] for r in sub))
        sizes = sorted({r["bytes"] for r in sub})
        lines.append(f"\nworld size {n} ({sub[0]['threads_per_rank']} torch thread(s) per rank): "
                     "bus bandwidth GB/s, measured median [model prediction, error]")
        lines.append("size".rjust(6) + "".join(a.rjust(24) for a in algos) + "  quiet/tries")
        for m in sizes:
            cells = []
            for a in algos:
                r = next(r for r in sub if r["algorithm"] == a and r["bytes"] == m)
                pb = m / r["predicted_s"] * 2 * (n - 1) / n / 1e9 if r["predicted_s"] else 0
                cells.append(f"{r['busbw_GBps']:.3f} [{pb:.3f} {r['model_error']:+.0%}]")
            lines.append(_human(m).rjust(6) + "".join(c.rjust(24) for c in cells)
                         + f"  {r.get('quiet_repeats', '-')}/{r.get('tries', '-')}".rjust(13))
        big = [r for r in sub if r["bytes"] >= (1 << 20)]
        within = [f"{a} {sum(abs(r['model_error']) <= 0.25 for r in big if r['algorithm'] == a)}"
                  f"/{sum(r['algorithm'] == a for r in big)}" for a in algos]
        lines.append("model within 25% of the median, sizes >= 1 MiB: " + ", ".join(within))
        native = {r["bytes"]: r["median_s"] for r in sub if r["algorithm"] == "native"}
        if native and "ring" in algos:
            ratios = [f"{_human(m)}: {native[m] / r['median_s']:.2f}x" for r in sub
                      if r["algorithm"] == "ring" and r["bytes"] >= (16 << 20)
                      for m in [r["bytes"]]]
            if ratios:
                lines.append("ring vs native (speed-up, >= 16 MiB): " + ", ".join(ratios))
        for a in ("shm", "hierarchical"):
            mine = {r["bytes"]: r["median_s"] for r in sub if r["algorithm"] == a}
            if native and mine:
                ratios = [f"{_human(m)}: {native[m] / t:.2f}x" for m, t in sorted(mine.items())
                          if m >= (16 << 20) and m in native]
                lat = [f"{_human(m)}: {a} {t * 1e3:.3f} ms, native {native[m] * 1e3:.3f} ms"
                       for m, t in sorted(mine.items()) if m <= (4 << 10) and m in native]
                lines.append(f"{a} vs native (speed-up, >= 16 MiB): " + ", ".join(ratios)
                             + ("; latency " + ", ".join(lat) if lat else ""))
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Draw measured bus bandwidth (and the cost model's prediction) against message size, one panel
    per world size, to the image ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    wss = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(1, len(wss), figsize=(6.5 * len(wss), 4.8), squeeze=False)
    for ax, n in zip(axes[0], wss):
        sub = [r for r in rows if r["world_size"] == n]
        for i, a in enumerate(dict.fromkeys(r["algorithm"] for r in sub)):
            pts = sorted((r["bytes"], r["busbw_GBps"], r["bytes"] / r["predicted_s"]
                          * 2 * (n - 1) / n / 1e9) for r in sub if r["algorithm"] == a)
            color = f"C{i}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=a)
            ax.plot([p[0] for p in pts], [p[2] for p in pts], ":", color=color, alpha=0.7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size X (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"all-reduce, N = {n} gloo ranks (dotted: cost model)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)


def _human(m: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if m >= size and m % size == 0:
            return f"{m // size}{unit}"
    return str(m)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``shardwise bench comm``: the sweep, ``--table`` and ``--calibrate``."""
    p = Parser(prog="shardwise bench comm", description=__doc__.split("\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", action="store_true", help="print the seeds' comparison table "
                   "from measured counters")
    p.add_argument("--calibrate", action="store_true", help="measure alpha/beta/gamma and "
                   "write a hardware profile")
    p.add_argument("--world-size", type=int, nargs="+", default=None,
                   help="world sizes (sweep/calibrate default: 2 4; table default: 2 4 8)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes (default {DEFAULT_SIZES})")
    p.add_argument("--algorithms", default=",".join(DEFAULT_ALGORITHMS),
                   help=f"comma-separated list of {', '.join(ALGORITHMS)}")
    p.add_argument("--fake-hosts", type=int, default=0, help="ranks per fake host "
                   "($SHARDWISE_HOST_ID = rank // K), for the hierarchical algorithm on one "
                   "machine (world sizes not a multiple of K, or <= K, skip it)")
    p.add_argument("--repeats", type=int, default=5, help="alternated repeats (median reported)")
    p.add_argument("--spawns", type=int, default=3, help="fresh sets of ranks per world size, "
                   "repeats pooled (default 3: the scheduler places ranks per spawn)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank "
                   "(default: cores // ranks, at least 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="--calibrate on: cpu (gloo) or cuda (NCCL, one GPU per rank); the "
                   "profile records the backend and the GPU model, and auto uses it for "
                   "those only")
    p.add_argument("--check", action="store_true", help="keep the argument check on while timing")
    p.add_argument("--out", default="runs/bench_comm", help="directory for results JSON and PNG")
    p.add_argument("--profile", default=None, help="profile JSON to predict with (default: "
                   "the active one); with --calibrate, where to write it")
    p.add_argument("--name", default="default", help="profile name for --calibrate "
                   "(written to profiles/NAME.json unless --profile is given)")
    return p


def _validate(args) -> None:
    if args.table and args.calibrate:
        raise BenchError("--table and --calibrate are separate runs; give one of them")
    for n in args.world_size or []:
        if not 1 <= n <= 64:
            raise BenchError(f"--world-size: {n} is out of range 1..64")
    if args.repeats < 1:
        raise BenchError(f"--repeats must be >= 1, got {args.repeats}")
    if args.fake_hosts < 0:
        raise BenchError(f"--fake-hosts must be >= 0, got {args.fake_hosts}")
    if args.spawns < 1:
        raise BenchError(f"--spawns must be >= 1, got {args.spawns}")
    if args.threads is not None and args.threads < 1:
        raise BenchError(f"--threads must be >= 1, got {args.threads}")
    bad = [a for a in args.algorithms.split(",") if a not in ALGORITHMS]
    if bad:
        raise BenchError(f"--algorithms: unknown {bad}; choose from {', '.join(ALGORITHMS)}")
    if args.profile and not args.calibrate and not Path(args.profile).is_file():
        raise BenchError(f"--profile: no such file {args.profile}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``shardwise bench comm``; returns the exit code (2: bad input)."""
    args = parse_or_code(build_parser(), argv)
    if isinstance(args, int):  # --help (0) or a one-line error (2)
        return args
    try:
        _validate(args)
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        if args.profile and not args.calibrate:
            cost.use_profile(args.profile)
    except (BenchError, ValueError) as exc:
        print(f"shardwise bench comm: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(args.out)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if args.table:
        rows = table_mod.measure(args.world_size or [2, 4, 8])
        print(table_mod.format_table(rows))
        out.mkdir(parents=True, exist_ok=True)
        write_text(out / "table.json", json.dumps(rows, indent=1))
        return 0
    if args.calibrate:
        from shardwise.cli.calibrate import calibrate
        prof, raw = calibrate(args.world_size or [2, 4], args.name, args.repeats,
                              threads=args.threads, spawns=args.spawns, device=args.device)
        prof.meta["loadavg_1min_before"] = load
        path = prof.save(args.profile or cost.REPO_PROFILE.parent / f"{args.name}.json")
        print(json.dumps(prof.to_json(), indent=2))
        print(f"wrote {path}")
        return 0
    rows = run_sweep(args.world_size or [2, 4], sizes, args.algorithms.split(","),
                     args.repeats, args.threads, args.check, args.spawns, args.fake_hosts)
    out.mkdir(parents=True, exist_ok=True)
    from shardwise.comm.primitives import settings
    meta = cost.host_meta() | {"loadavg_1min_before": round(load, 2),
                               "loadavg_1min_after": round(os.getloadavg()[0], 2),
                               "profile": cost.active_profile().name,
                               "check": args.check, "repeats": args.repeats,
                               "fake_hosts": args.fake_hosts,
                               "spawns": args.spawns, "segment_bytes": settings.segment_bytes,
                               "torch": torch.__version__,
                               "command": "shardwise bench comm " + " ".join(
                                   argv if argv is not None else sys.argv[1:])}
    write_text(out / "allreduce.json", json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, out / "allreduce_busbw.png")
    text = format_sweep(rows) + "\n\nmeta: " + json.dumps(meta)
    write_text(out / "allreduce.txt", text.lstrip("\n") + "\n")
    print(text)
    print(f"\nwrote {out / 'allreduce.txt'}, {out / 'allreduce.json'} and "
          f"{out / 'allreduce_busbw.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
