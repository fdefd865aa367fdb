"""examples/slurm/train.sbatch on a real Slurm of one node: requeue, scancel, resubmit, resume.

Starts munged, slurmctld and slurmd on this machine (``tests/slurm_cluster.py``: a network
namespace with only addresses of its own, a temporary slurm.conf, stopped and removed at the
end), submits the example with two tasks on the node (two torchrun agents, one rank each:
dp=2); once a checkpoint exists, has Slurm requeue it (``scontrol requeue``: the job runs
again under its id); after the next checkpoint cancels it with ``scancel``, submits it again
and waits.
Prints each job's sbatch command, state and last lines of output. Needs root and Debian's
``slurm-wlm`` and ``munge`` packages.

    .venv/bin/python benchmarks/slurm_example.py --data CORPUS
    .venv/bin/python benchmarks/slurm_example.py --data CORPUS --nodes 2 --steps 20

``--nodes 2``: two Slurm nodes (namespaces joined by a veth pair, each slurmd at its own
address), one task on each: dp=2 across the nodes, one job run through.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from slurm_cluster import requeue_cancel_resubmit, slurm_cluster, unavailable  # noqa: E402

SBATCH = REPO / "examples" / "slurm" / "train.sbatch"


def show(job: int, state: str, log: str, tmp: str, head: int, tail: int) -> None:
    """A job's state, the first and last lines of its output, then its key lines (each
    attempt's first line, resumes, cancellations, the closing line)."""
    print(f"\n## job {job}: {state}; its output's first {head} and last {tail} lines")
    lines = [ln.replace(tmp, "TMP") for ln in log.splitlines()]
    if len(lines) > head + tail:
        lines = lines[:head] + ["..."] + lines[-tail:]
    print("\n".join(lines))
    keys = [ln.replace(tmp, "TMP") for ln in log.splitlines()
            if ln.startswith(("shardwise-slurm:", "shardwise: resumed", "shardwise: done",
                              "slurmstepd"))]
    print(f"## job {job}: its key lines\n" + "\n".join(keys))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                    help="1: two tasks on one node, requeued, cancelled, resubmitted; "
                         "2: one task on each of two nodes, one job run through")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=10, help="checkpoint.every")
    ap.add_argument("--head", type=int, default=8, help="first lines of each job's output")
    ap.add_argument("--tail", type=int, default=8, help="last lines of each job's output")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds, each wait")
    a = ap.parse_args()
    if (why := unavailable()) is not None:
        sys.exit(f"slurm_example: {why}")
    with tempfile.TemporaryDirectory(prefix="shardwise-slurm-run-") as tmp:
        out, logs = Path(tmp) / "run", Path(tmp) / "logs"
        logs.mkdir()
        env = {"PYTHON": sys.executable, "OUT_DIR": str(out), "NPROC_PER_NODE": "1",
               "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO / "src"),
                                              os.environ.get("PYTHONPATH", "")])}
        options = ["--job-name=shardwise-example", f"--nodes={a.nodes}",
                   f"--ntasks-per-node={2 // a.nodes}", "--cpus-per-task=1",
                   f"--output={logs}/slurm-%j.out"]
        args = ["--config", "configs/tiny.toml", "--data", str(Path(a.data).resolve()),
                "--training.steps", str(a.steps), "--checkpoint.every", str(a.every),
                "--training.sample_chars", "0"]
        version = subprocess.run(["slurmctld", "-V"], capture_output=True, text=True).stdout
        print(f"# {version.strip()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
        print("OUT_DIR=RUN NPROC_PER_NODE=1 sbatch " + shlex.join(options).replace(
            str(logs), "LOGS") + " examples/slurm/train.sbatch " +
            shlex.join(args).replace(str(Path(a.data).resolve()), "CORPUS"))
        started = time.perf_counter()
        with slurm_cluster(cpus=3 - a.nodes, nodes=a.nodes) as cluster:
            if a.nodes == 2:
                job = cluster.sbatch(SBATCH, options, args, env, cwd=REPO)
                state = cluster.wait(job, ("COMPLETED",), timeout=a.timeout)
                cluster.wait_gone(job, timeout=60)
                print(f"# nodes: {', '.join(f'{n.name} at {n.addr}' for n in cluster.nodes)}")
            else:
                run = requeue_cancel_resubmit(cluster, SBATCH, options, args, env, out, logs,
                                              cwd=REPO, timeout=a.timeout)
        took = time.perf_counter() - started
        if a.nodes == 2:
            show(job, state, (logs / f"slurm-{job}.out").read_text(), tmp, a.head, a.tail)
        else:
            show(run.first, run.first_state, run.first_log, tmp, a.head, a.tail)
            print(f"## scontrol requeue {run.first} at checkpoint {run.requeued_at}, its "
                  f"second attempt cancelled (scancel) at checkpoint {run.saved}; the same "
                  "sbatch again")
            show(run.second, run.second_state, run.second_log, tmp, a.head, a.tail)
        print(f"\n# daemons started, jobs run, daemons stopped: {took:.0f} s")


if __name__ == "__main__":
    main()
