"""torchrun's own recovery from a lost host: two namespace hosts, one killed whole and restarted.

Two hosts (network namespaces, ``tests/hosts.py``; needs root and iproute2) each run
``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --max-restarts 3`` of a dp=2
``configs/tiny.toml`` run (``--steps`` steps, a checkpoint every ``--every``). Once the run
passes step ``--kill-at``, every process of host ``--kill`` is SIGKILLed and its torchrun is
started again ``--restart-after`` seconds later. Printed: each agent's exit code and time,
the last step logged, and the tail of each agent's log.

    .venv/bin/python benchmarks/host_loss_torchrun.py --data CORPUS --kill 1
    .venv/bin/python benchmarks/host_loss_torchrun.py --data CORPUS --kill 1 \\
        --endpoint-host 2     # the rendezvous store on a third host that runs no ranks
"""

from __future__ import annotations

import argparse
import signal
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from hosts import hosts  # noqa: E402

from shardwise.training.metrics import read_metrics  # noqa: E402


def last_step(out: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(out / "metrics.jsonl")
                    if r["kind"] == "train"), default=0)
    except (OSError, ValueError):
        return 0


def metric_lines(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--kill", type=int, default=1, help="the host killed: 0 or 1")
    ap.add_argument("--endpoint-host", type=int, default=0,
                    help="the host whose agent serves the c10d store (2: a third host "
                         "running a store only)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--kill-at", type=int, default=30)
    ap.add_argument("--restart-after", type=float, default=2.0)
    ap.add_argument("--wait", type=float, default=300.0, help="seconds after the kill")
    ap.add_argument("--no-shared-store", action="store_true",
                    help="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 of each round serves "
                         "the ranks' store, the agents' rendezvous store is not shared")
    args = ap.parse_args()
    # SIGTERM as an exception, so that hosts() removes its namespaces and processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO / "src"))
    if args.no_shared_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with tempfile.TemporaryDirectory() as tmp, hosts(3 if args.endpoint_host == 2 else 2) as net:
        out = Path(tmp) / "run"
        endpoint = f"host{args.endpoint_host}:29400"
        if args.endpoint_host == 2:  # a standalone TCPStore on host2, as torchrun's is_host
            store = ("import time, datetime, torch.distributed as d; s = d.TCPStore("
                     "'0.0.0.0', 29400, is_master=True, wait_for_workers=False,"
                     " timeout=datetime.timedelta(seconds=3600)); time.sleep(3600)")
            net.popen(net[2], [sys.executable, "-c", store])
            time.sleep(3)
        cmd = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
               "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "host-loss",
               "--max-restarts", "3", "-m", "shardwise", "train", "--config",
               "configs/tiny.toml", "--data", args.data, "--training.out_dir", str(out),
               "--training.threads", "1", "--training.progress", "false",
               "--training.sample_chars", "0", "--training.steps", str(args.steps),
               "--checkpoint.every", str(args.every)]
        logs = [open(Path(tmp) / f"agent{i}.log", "w+") for i in range(3)]

        def start(i: int, log) -> subprocess.Popen:
            return net.popen(net[i], cmd, cwd=REPO, env=env, stdout=log,
                             stderr=subprocess.STDOUT)

        agents = [start(0, logs[0]), start(1, logs[1])]
        t0 = time.monotonic()
        while last_step(out) < args.kill_at and time.monotonic() - t0 < 300:
            time.sleep(0.2)
        killed_at_step, lines = last_step(out), metric_lines(out)
        net.kill_host(net[args.kill])
        t_kill = time.monotonic()
        print(f"killed host{args.kill} at step {killed_at_step}")
        time.sleep(args.restart_after)
        agents.append(start(args.kill, logs[2]))
        live = [agents[1 - args.kill], agents[2]]
        ends: dict[int, float] = {}
        first_step_after = None
        while len(ends) < 2 and time.monotonic() - t_kill < args.wait:
            for j, a in enumerate(live):
                if j not in ends and a.poll() is not None:
                    ends[j] = time.monotonic() - t_kill
            if first_step_after is None and metric_lines(out) > lines:
                first_step_after = time.monotonic() - t_kill
            time.sleep(0.1)
        if first_step_after is not None:
            print(f"kill to the first step logged after it: {first_step_after:.1f} s")
        names = [f"host{1 - args.kill} (survivor)", f"host{args.kill} (restarted)"]
        for j, a in enumerate(live):
            rc = a.poll()
            when = f"{ends[j]:.1f} s after the kill" if j in ends else "still running"
            print(f"{names[j]}: rc {rc}, {when}")
        print(f"last step logged: {last_step(out)} of {args.steps}")
        for name, log in [(names[0], logs[1 - args.kill]), (names[1], logs[2])]:
            log.flush()
            log.seek(0)
            tail = [ln for ln in log.read().splitlines() if ln.strip()][-8:]
            print(f"--- {name}, last lines:\n" + "\n".join(ln[:300] for ln in tail))


if __name__ == "__main__":
    main()
