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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
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
        options = ["--job-name=shardwise-example", "--nodes=1", "--ntasks-per-node=2",
                   "--cpus-per-task=1", f"--output={logs}/slurm-%j.out"]
        args = ["--config", "configs/tiny.toml", "--data", str(Path(a.data).resolve()),
                "--training.steps", str(a.steps), "--checkpoint.every", str(a.every),
                "--training.sample_chars", "0"]
        version = subprocess.run(["slurmctld", "-V"], capture_output=True, text=True).stdout
        print(f"# {version.strip()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
        print("OUT_DIR=RUN NPROC_PER_NODE=1 sbatch " + shlex.join(options).replace(
            str(logs), "LOGS") + " examples/slurm/train.sbatch " +
            shlex.join(args).replace(str(Path(a.data).resolve()), "CORPUS"))
        started = time.perf_counter()
        with slurm_cluster(cpus=2) as cluster:
            run = requeue_cancel_resubmit(cluster, SBATCH, options, args, env, out, logs,
                                          cwd=REPO, timeout=a.timeout)
        took = time.perf_counter() - started
        for job, state, log in ((run.first, run.first_state, run.first_log),
                                (run.second, run.second_state, run.second_log)):
            print(f"\n## job {job}: {state}; its output's first {a.head} and last {a.tail} "
                  "lines")
            lines = [ln.replace(tmp, "TMP") for ln in log.splitlines()]
            if len(lines) > a.head + a.tail:
                lines = lines[:a.head] + ["..."] + lines[-a.tail:]
            print("\n".join(lines))
            if job == run.first:
                print(f"## scontrol requeue {job} at checkpoint {run.requeued_at}, its "
                      f"second attempt cancelled (scancel) at checkpoint {run.saved}; the "
                      "same sbatch again")
        print(f"\n# both jobs, daemons started and stopped: {took:.0f} s")


if __name__ == "__main__":
    main()
