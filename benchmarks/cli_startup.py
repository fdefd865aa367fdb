"""Wall time of the command line as a user meets it: the door (``shardwise --help``,
``--version``, the helps of ``train``, ``memory`` and ``plan``, a misspelt key in a TOML and
a misspelt ``model.kind``, the last two told in one line with exit 2; target: each under
1 s on 2 cores, torch not imported), and a 3-step bf16 training run of the tiny GPT on one
CPU rank (budget: 15 s on 2 cores), each run a few times in a fresh process.

    python benchmarks/cli_startup.py            # 3 repeats; writes cli_results/cli_startup.txt
    python benchmarks/cli_startup.py --repeats 5
    python benchmarks/cli_startup.py --door-only --baseline /work/main/src \
        --out benchmarks/cli_results/cli_door.txt   # the door rows, another tree's code too
    python benchmarks/cli_startup.py --door-only --only "memory --help" "plan --help" gtp \
        --baseline OLD/src --append --out benchmarks/cli_results/cli_door.txt   # some rows

``--baseline SRC`` times each door command with the code under SRC as well, run by run in
turn with this checkout's (so both meet the same load), labelled ``before`` and ``after``.

Every training run writes to a temporary out_dir, and every command sees a temporary
``XDG_CACHE_HOME``, so the runs start with no cached CPU peak, as on a new machine (and
leave this machine's cache alone). For the training run the times at which its lines appear
split the wall time into phases: start (imports, config and corpus checks, spawning the
rank, building the model: up to the first line), the steps, and the end (validation,
checkpoint, loss curve, the generated sample). The ``mfu=`` shown by the progress bar is
recorded too: a bf16 CPU run has no measured bf16 peak, so it must read ``n/a``.

The machine is shared: the load average before each command is recorded with it.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "cli_results" / "cli_startup.txt"
BUDGET_S = 15.0
DOOR_S = 1.0  # each door command (issue 41)
TYPO = "[training]\nstepz = 3\n"  # the door's answer: training.stepz: unknown key; did you mean ...
TRAIN = ["train", "--config", "configs/tiny.toml", "--training.precision", "bf16",
         "--parallel.dp", "1", "--training.steps", "3"]
MARKS = {"first line": "shardwise: gpt ", "loss curve": "loss curve:", "sample": "sample:"}


def with_src(env: dict, src: Path) -> dict:
    """``env`` with ``src`` first on PYTHONPATH (the shardwise tree whose code is timed)."""
    return dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(src),
                                                              os.environ.get("PYTHONPATH")])))


def run(args: list[str], env: dict) -> dict:
    """Run ``python -m shardwise ARGS``; wall seconds, exit code, when each mark appeared,
    and the last ``mfu=`` of the progress bar."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "shardwise", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: dict[str, float] = {}
    text = b""
    while chunk := proc.stdout.read1(4096):
        now = time.perf_counter() - t0
        text += chunk
        for mark, needle in MARKS.items():
            if mark not in seen and needle.encode() in text:
                seen[mark] = now
    code = proc.wait()
    wall = time.perf_counter() - t0
    mfu = re.findall(rb"mfu=([^,\]\s]+)", text)
    return {"wall": wall, "code": code, "marks": seen,
            "mfu": mfu[-1].decode() if mfu else "-", "tail": text.decode(errors="replace")[-2000:]}


def machine() -> str:
    import torch

    from shardwise.perf.peak import cpu_name

    cpu = cpu_name()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{cpu}, {usable} usable cores ({os.cpu_count()} online); torch {torch.__version__}; "
            f"Python {platform.python_version()}; {platform.system()} {platform.release()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each command (default 3)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"results file (default {OUT.relative_to(REPO)})")
    ap.add_argument("--door-only", action="store_true", help="only the door rows (no training run)")
    ap.add_argument("--baseline", type=Path, metavar="SRC",
                    help="time the door rows with the shardwise tree under SRC too (before)")
    ap.add_argument("--only", nargs="+", metavar="WORDS", help="only the door rows whose "
                    "command contains one of WORDS (e.g. 'memory --help')")
    ap.add_argument("--append", action="store_true", help="append to --out (a section of "
                    "its own) instead of replacing it")
    args = ap.parse_args()
    command = " ".join(["python benchmarks/cli_startup.py", *sys.argv[1:]])
    lines = [f"# shardwise CLI wall times, {time.strftime('%Y-%m-%d %H:%M')}",
             f"# machine: {machine()}",
             f"# command: {command}",
             "# each command in a fresh process; a fresh XDG_CACHE_HOME (no cached CPU peak); "
             "load = 1-min load average before the run", ""]
    print("\n".join(lines), flush=True)
    worst = door = 0.0
    with tempfile.TemporaryDirectory(prefix="shardwise-cli-") as tmp:
        base = dict(os.environ, PYTHONUNBUFFERED="1", XDG_CACHE_HOME=str(Path(tmp) / "cache"))
        trees = [("after", with_src(base, REPO / "src"))]
        if args.baseline is not None:
            trees.insert(0, ("before", with_src(base, args.baseline.resolve())))
            lines.insert(3, f"# before: {args.baseline}; after: {REPO / 'src'}")
        typo = Path(tmp) / "typo.toml"
        typo.write_text(TYPO)
        # (label, argv, expected exit code, trees)
        commands = [("shardwise --help", ["--help"], 0, trees),
                    ("shardwise --version", ["--version"], 0, trees),
                    ("shardwise train --help", ["train", "--help"], 0, trees),
                    ("shardwise memory --help", ["memory", "--help"], 0, trees),
                    ("shardwise plan --help", ["plan", "--help"], 0, trees),
                    ("shardwise train --config typo.toml  ([training] stepz = 3)",
                     ["train", "--config", str(typo)], 2, trees),
                    ("shardwise train --model.kind gtp", ["train", "--model.kind", "gtp"], 2,
                     trees)]
        if args.only:
            commands = [c for c in commands if any(w in c[0] for w in args.only)]
        if not args.door_only:
            commands.append(("shardwise " + " ".join(TRAIN), TRAIN, 0, trees[-1:]))
        for label, argv, expected, runs_in in commands:
            is_train = argv is TRAIN
            lines.append(f"$ {label}")
            print(lines[-1], flush=True)
            for i in range(args.repeats):
                for name, env in runs_in:
                    load = os.getloadavg()[0]
                    if is_train:
                        argv = TRAIN + ["--training.out_dir", str(Path(tmp) / f"run{i}")]
                    r = run(argv, env)
                    if r["code"] != expected:
                        print(r["tail"], file=sys.stderr)
                        raise SystemExit(f"{label}: exit code {r['code']}, not {expected}")
                    tag = f"{name:>6} " if len(runs_in) > 1 else ""
                    row = f"  {tag}run {i + 1}: {r['wall']:6.2f} s  (load {load:.1f})"
                    if is_train:
                        worst = max(worst, r["wall"])
                        m = r["marks"]
                        first, curve = m.get("first line", 0.0), m.get("loss curve", r["wall"])
                        sample = m.get("sample", r["wall"])
                        row += (f"  start {first:.2f} s, steps+validation+checkpoint "
                                f"{curve - first:.2f} s, sample {sample - curve:.2f} s, "
                                f"exit {r['wall'] - sample:.2f} s; mfu={r['mfu']}")
                    elif name == "after":
                        door = max(door, r["wall"])
                    print(row, flush=True)
                    lines.append(row)
            lines.append("")
    verdicts = [f"door (this checkout): slowest {door:.2f} s against a target of {DOOR_S:.0f} s: "
                f"{'within' if door < DOOR_S else 'OVER'}"]
    if not args.door_only:
        verdicts.append(f"train: slowest {worst:.2f} s against a budget of {BUDGET_S:.0f} s: "
                        f"{'within' if worst < BUDGET_S else 'OVER'}")
    print("\n".join(verdicts))
    lines += verdicts
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    if args.append and args.out.exists():
        text = args.out.read_text() + "\n" + text
    args.out.write_text(text)
    print(f"written: {args.out}")
    return 0 if worst < BUDGET_S and door < DOOR_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
