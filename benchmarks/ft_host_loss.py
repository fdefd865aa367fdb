"""Per-step fault tolerance (torchft) across namespace hosts: host loss, soak, lighthouse loss.

Hosts are network namespaces (``tests/hosts.py``; root and iproute2). torchft's lighthouse
runs on its own host; each replica group is ``tests/ft_workers.py`` (a toy model, one
process) on a host of its own, a step computing ``--step-sleep`` seconds.

- ``--scenario host-loss``: two replica hosts; ``--trials`` times, once both commit together,
  every process of host1 is SIGKILLed and its replica started again ``--restart-after`` s
  later. Per trial: kill to the survivor's first step committed without host1, the longest
  pause between two of the survivor's commits, restart to the restarted replica's first
  commit (its heal), steps lost (steps the survivor had committed and had to redo: always
  0 by design, checked), and whether the healed replica's parameters equal the survivor's
  bit for bit at every common step.
- ``--scenario soak``: three replica hosts; ``--kills`` random kills (a whole host, or the
  replica process alone) at random times, each victim restarted; at the end every
  replica's parameters are compared bit for bit after each heal.
- ``--scenario lighthouse-loss``: two replica hosts; the lighthouse's host is killed whole
  mid-run and, with ``--restart-after``, the lighthouse started again on the same address.

    .venv/bin/python benchmarks/ft_host_loss.py --scenario host-loss --trials 5
    .venv/bin/python benchmarks/ft_host_loss.py --scenario soak --kills 20
    .venv/bin/python benchmarks/ft_host_loss.py --scenario lighthouse-loss
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from ft_workers import lighthouse_on, records, start_on  # noqa: E402
from hosts import hosts  # noqa: E402

WAIT_S = 120.0


def wait_for(condition, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.02)


def equal_where_common(outs: list[Path], since: float) -> bool:
    """Every replica's parameter digest equal at every step two of them committed after
    ``since``."""
    seen: dict[int, str] = {}
    for out in outs:
        for r in records(out):
            if r["t"] > since and seen.setdefault(r["step"], r["digest"]) != r["digest"]:
                return False
    return True


def host_loss(args) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, hosts(3) as net:
        lighthouse = lighthouse_on(net, net[2], args.heartbeat_timeout_ms)
        outs = [Path(tmp) / f"r{i}.jsonl" for i in range(2)]
        common = ["--steps", "100000", "--max-steps", "100000000",
                  "--step-sleep", str(args.step_sleep),
                  "--timeout-ms", str(args.timeout_ms)]
        logs = [open(Path(tmp) / f"r{i}.log", "a") for i in range(2)]
        survivor = start_on(net, net[0], 0, lighthouse, outs[0], *common, log=logs[0])
        start_on(net, net[1], 1, lighthouse, outs[1], *common, log=logs[1])
        for trial in range(args.trials):
            wait_for(lambda: sum(r["live"] == 2 for r in records(outs[0])[-3:]) == 3,
                     "both replicas committing together")
            before = {r["step"] for r in records(outs[0])}
            kill = time.time()
            net.kill_host(net[1])
            wait_for(lambda: any(r["live"] == 1 and r["t"] > kill for r in records(outs[0])),
                     "the survivor committing alone")
            alone = next(r["t"] for r in records(outs[0]) if r["live"] == 1 and r["t"] > kill)
            time.sleep(args.restart_after)
            restart = time.time()
            start_on(net, net[1], 1, lighthouse, outs[1], *common, log=logs[1])
            wait_for(lambda: any(r["t"] > restart for r in records(outs[1])), "the heal")
            healed = next(r["t"] for r in records(outs[1]) if r["t"] > restart)
            ts = [r["t"] for r in records(outs[0]) if r["t"] > kill - 1]
            steps = [r["step"] for r in records(outs[0])]
            rows.append({"kill_to_commit_s": alone - kill,
                         "longest_pause_s": max(b - a for a, b in zip(ts, ts[1:])),
                         "restart_to_heal_s": healed - restart,
                         # committed steps redone or skipped: each step once, in order
                         "steps_lost": len(before) - len(set(steps) & before)
                         + (steps != list(range(steps[0], steps[0] + len(steps)))),
                         "bitwise": equal_where_common(outs, restart)})
            print(f"trial {trial}: " + ", ".join(
                f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in rows[-1].items()), flush=True)
        survivor.kill()
    for key in ("kill_to_commit_s", "longest_pause_s", "restart_to_heal_s"):
        vals = [r[key] for r in rows]
        print(f"{key}: {min(vals):.2f}-{max(vals):.2f} s (median {statistics.median(vals):.2f})")
    print(f"steps lost, at most: {max(r['steps_lost'] for r in rows)}; bitwise equal after "
          f"each heal: {sum(r['bitwise'] for r in rows)}/{len(rows)}")


def soak(args) -> None:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp, hosts(4) as net:
        lighthouse = lighthouse_on(net, net[3], args.heartbeat_timeout_ms)
        outs = [Path(tmp) / f"r{i}.jsonl" for i in range(3)]
        common = ["--group-size", "3", "--steps", "100000", "--max-steps", "100000000",
                  "--step-sleep", str(args.step_sleep), "--timeout-ms", str(args.timeout_ms)]
        logs = [open(Path(tmp) / f"r{i}.log", "a") for i in range(3)]
        procs = [start_on(net, net[i], i, lighthouse, outs[i], *common, log=logs[i])
                 for i in range(3)]
        t0, equal = time.time(), 0
        for k in range(args.kills):
            try:
                wait_for(lambda: all(records(o) and records(o)[-1]["live"] == 3 for o in outs)
                         and all(p.poll() is None for p in procs),
                         "all three replicas committing together")
            except TimeoutError:
                for i, p in enumerate(procs):
                    tail = (Path(tmp) / f"r{i}.log").read_text().splitlines()[-5:]
                    print(f"replica {i}: rc {p.poll()}\n  " + "\n  ".join(tail))
                raise
            time.sleep(rng.uniform(0.0, 2.0))
            victim, whole = rng.randrange(3), rng.random() < 0.5
            if whole:
                net.kill_host(net[victim])
            else:
                procs[victim].kill()
                procs[victim].wait()
            restart = time.time()
            procs[victim] = start_on(net, net[victim], victim, lighthouse, outs[victim],
                                     *common, log=logs[victim])
            wait_for(lambda: any(r["t"] > restart for r in records(outs[victim])), "the heal")
            time.sleep(0.5)
            ok = equal_where_common(outs, restart)
            equal += ok
            print(f"kill {k}: {'host' if whole else 'rank'} {victim}, healed, bitwise "
                  f"{'equal' if ok else 'DIFFERENT'}", flush=True)
        steps = [r["step"] for r in records(outs[0])]
        for p in procs:
            p.kill()
    print(f"{args.kills} kills in {time.time() - t0:.0f} s; bitwise equal after each heal: "
          f"{equal}/{args.kills}; committed steps {max(steps) + 1}, none twice on replica 0: "
          f"{len(steps) == len(set(steps))}")


def lighthouse_loss(args) -> None:
    with tempfile.TemporaryDirectory() as tmp, hosts(3) as net:
        lighthouse = lighthouse_on(net, net[2], args.heartbeat_timeout_ms)
        outs = [Path(tmp) / f"r{i}.jsonl" for i in range(2)]
        common = ["--steps", "100000", "--max-steps", "100000000",
                  "--step-sleep", str(args.step_sleep),
                  "--timeout-ms", str(args.timeout_ms),
                  "--quorum-timeout-ms", str(args.quorum_timeout_ms),
                  "--quorum-retries", str(args.quorum_retries)]
        procs = [start_on(net, net[i], i, lighthouse, outs[i], *common) for i in range(2)]
        wait_for(lambda: sum(r["live"] == 2 for r in records(outs[0])) >= 3, "commits")
        kill = time.time()
        net.kill_host(net[2])
        print("lighthouse host killed")
        if args.restart_after >= 0:
            time.sleep(args.restart_after)
            lighthouse_on(net, net[2], args.heartbeat_timeout_ms)
            print(f"lighthouse started again {args.restart_after:.1f} s later")
        deadline, ended = time.monotonic() + args.watch, {}
        while time.monotonic() < deadline and len(ended) < len(procs):
            for i, p in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.time() - kill
            time.sleep(0.1)
        for i, (p, out) in enumerate(zip(procs, outs)):
            last = [r for r in records(out) if r["t"] > kill]
            rc = p.poll()
            state = ("running" if rc is None
                     else f"exit {rc} {ended.get(i, args.watch):.1f} s after the kill")
            ts = [kill] + [r["t"] for r in last]
            pause = max((b - a for a, b in zip(ts, ts[1:])), default=float("nan"))
            print(f"replica {i}: {state}; longest pause from the kill {pause:.1f} s; "
                  f"{len(last)} steps committed after the kill")
            if rc is None:
                p.kill()
            tail = [ln for ln in (p.communicate()[0] or "").splitlines() if ln.strip()][-3:]
            print("  " + "\n  ".join(ln[:240] for ln in tail))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=("host-loss", "soak", "lighthouse-loss"),
                    default="host-loss")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--restart-after", type=float, default=2.0)
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    ap.add_argument("--timeout-ms", type=int, default=2000,
                    help="fault_tolerance.process_group_timeout_ms of each replica")
    ap.add_argument("--quorum-timeout-ms", type=int, default=60000,
                    help="lighthouse-loss: fault_tolerance.quorum_timeout_ms of each replica")
    ap.add_argument("--quorum-retries", type=int, default=3,
                    help="lighthouse-loss: fault_tolerance.quorum_retries of each replica")
    ap.add_argument("--watch", type=float, default=60.0,
                    help="lighthouse-loss: seconds to watch the replicas after the kill")
    args = ap.parse_args()
    # SIGTERM as an exception, so that hosts() removes its namespaces and processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    {"host-loss": host_loss, "soak": soak, "lighthouse-loss": lighthouse_loss}[
        args.scenario](args)


if __name__ == "__main__":
    main()
