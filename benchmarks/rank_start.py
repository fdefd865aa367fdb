"""How long ``launch.spawn`` takes to start N ranks that import what a training rank imports,
with each start method: a fresh interpreter per rank (``spawn``) against ranks forked from a
fork server that imported torch once (``forkserver``, ``launch.PRELOAD``; what ``spawn``
uses where it exists). Each rank joins the process group, imports ``shardwise.apps.jobs``
(the module ``shardwise train``'s ranks run) and returns; the wall time is the whole
``launch.spawn`` call, start to every rank joined. ``cold``: the first call of a process
(the fork server starts and imports ``PRELOAD``; each ``spawn`` row runs in a fresh
process too); ``warm``: the median of the later calls (the server is running).

    python benchmarks/rank_start.py                 # 1, 2, 4, 8 ranks; 3 warm calls each
    python benchmarks/rank_start.py --ranks 2 8 --repeats 5

Writes ``benchmarks/rank_start_results/rank_start.md`` (or ``--out``). A few minutes on 2
cores; the machine's load average before each row is recorded with it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "rank_start_results" / "rank_start.md"


def training_imports() -> int:
    """Rank function: import what a training rank imports; return this process's pid."""
    import shardwise.apps.jobs  # noqa: F401

    return os.getpid()


def one_row(method: str, ranks: int, repeats: int) -> dict:
    """In this (fresh) process: the first ``spawn`` call and ``repeats`` more, in seconds."""
    from shardwise import launch

    launch.START_METHOD = method
    times = []
    for _ in range(1 + repeats):
        t0 = time.perf_counter()
        pids = launch.spawn(training_imports, ranks, threads=1)
        times.append(time.perf_counter() - t0)
        assert len(set(pids)) == ranks and os.getpid() not in pids
    return {"cold": times[0], "warm": statistics.median(times[1:]) if repeats else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=3, help="warm calls per row")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--row", nargs=2, help=argparse.SUPPRESS)  # internal: METHOD RANKS
    args = ap.parse_args()
    if args.row:
        print(json.dumps(one_row(args.row[0], int(args.row[1]), args.repeats)))
        return
    import torch

    from shardwise import launch

    lines = ["# Rank start: `launch.spawn` of N ranks importing a training rank's modules", "",
             f"- machine: {platform.machine()}, {launch.available_cores()} cores, "
             f"{platform.processor() or platform.platform()}",
             f"- python {platform.python_version()}, torch {torch.__version__}; threads 1 a rank",
             f"- preloaded by the fork server: {', '.join(launch.PRELOAD)}",
             f"- command: `python benchmarks/rank_start.py --ranks {' '.join(map(str, args.ranks))}"
             f" --repeats {args.repeats}`", "",
             "| ranks | start method | first call, s | later calls (median), s | load before |",
             "|---:|---|---:|---:|---:|"]
    for ranks in args.ranks:
        for method in ("spawn", "forkserver"):
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, __file__, "--row", method, str(ranks),
                                  "--repeats", str(args.repeats)], capture_output=True,
                                 text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            lines.append(f"| {ranks} | {method} | {row['cold']:.2f} | {row['warm']:.2f} | "
                         f"{load:.1f} |")
            print(lines[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
