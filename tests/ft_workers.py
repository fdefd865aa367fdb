"""One replica group of a torchft job, as its own process: a deterministic toy model (plain
torch modules and an optimizer with state) trained through ``training.fault_tolerance``.

    python tests/ft_workers.py --replica-id 0 --group-size 2 --lighthouse http://... \\
        --steps 12 --out replica0.jsonl [--die-after 3]

Step s of replica r trains on slot r of global batch s (``batch``); each committed step
appends one JSON line to ``--out`` (step, live replica groups, time, the parameters' bytes
as a hex digest and their values). A replica stops once it has committed ``--steps`` steps
in a row with every replica group live (replicas that commit together stop together; a
survivor waits for the lost one to rejoin; ``--max-steps`` bounds it). ``--die-after N``:
SIGKILL itself in the Nth step it runs, after its backward, before the cross-replica average
(a replica lost mid-step). ``reference`` replays the committed steps in one process;
``start_on`` and ``lighthouse_on`` run a replica and the lighthouse on namespace hosts."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

SLOT = 4  # samples per replica slot of a global batch
DIM = 6


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot ``slot`` of global batch ``step``: the same samples wherever it is read."""
    g = torch.Generator().manual_seed(1000 * step + slot)
    x = torch.randn(SLOT, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def grads_of(model: torch.nn.Module, step: int, slot: int) -> torch.Tensor:
    x, y = batch(step, slot)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.detach()


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def reference(commits: list[tuple[int, list[int]]]) -> list[float]:
    """One process training the committed steps: step s averages the gradients of the
    slots of the replica groups live at s (``commits``: (step, slots) in order)."""
    model, opt = make_model()
    for step, slots in commits:
        total = [torch.zeros_like(p) for p in model.parameters()]
        for slot in slots:
            grads_of(model, step, slot)
            for t, p in zip(total, model.parameters()):
                t += p.grad
            opt.zero_grad()
        for t, p in zip(total, model.parameters()):
            p.grad = t / len(slots)
        opt.step()
        opt.zero_grad()
    return flat(model)


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def start_on(net, host, replica: int, lighthouse: str, out: Path, *extra: str, log=None):
    """A replica group on a namespace host, reached by the others at that host's address;
    its output to the file object ``log``, else a pipe (read it: a full pipe blocks it)."""
    return net.popen(host, [sys.executable, __file__, "--replica-id", str(replica),
                            "--lighthouse", lighthouse, "--out", str(out), "--host", host.addr,
                            *extra], env=dict(os.environ, PYTHONUNBUFFERED="1"),
                     stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def lighthouse_on(net, host, heartbeat_timeout_ms: int = 1000, join_timeout_ms: int = 200):
    """torchft's own lighthouse binary on ``host``, bound to its address only; a quorum waits
    ``join_timeout_ms`` for a group that heartbeats but has not asked yet."""
    binary = str(Path(sys.executable).with_name("torchft_lighthouse"))
    net.popen(host, [binary, "--min_replicas", "1", "--bind", f"{host.addr}:29510",
                     "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms",
                     str(heartbeat_timeout_ms)], env=dict(os.environ, RUST_LOG="warn"),
              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return f"http://{host.addr}:29510"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica-id", type=int, required=True)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--die-after", type=int, default=0,
                    help="SIGKILL itself in the Nth step this process runs (0: never)")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds a step computes")
    ap.add_argument("--max-steps", type=int, default=1000, help="bound: stop here anyway")
    ap.add_argument("--host", default="127.0.0.1", help="address the other replicas reach")
    ap.add_argument("--timeout-ms", type=int, default=10000)
    ap.add_argument("--quorum-timeout-ms", type=int, default=60000)
    ap.add_argument("--quorum-retries", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from shardwise.base.config import FaultToleranceConfig
    from shardwise.training.fault_tolerance import FaultTolerantReplica, QuorumError

    torch.set_num_threads(1)
    cfg = FaultToleranceConfig(replica_id=args.replica_id,
                               group_size=args.group_size, min_replica_size=args.min_replicas,
                               lighthouse=args.lighthouse,
                               process_group_timeout_ms=args.timeout_ms,
                               quorum_timeout_ms=args.quorum_timeout_ms,
                               quorum_retries=args.quorum_retries)
    model, opt = make_model()
    store = torch.distributed.TCPStore(args.host, 0, is_master=True, wait_for_workers=False)
    ft = FaultTolerantReplica(
        cfg, state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                    opt.load_state_dict(sd["optim"])),
        device=torch.device("cpu"), store_addr=args.host, store_port=store.port,
        hostname=args.host, bind=args.host,
        log=lambda s: print(s, flush=True))
    full, ran = 0, 0  # steps committed in a row with every replica group live
    with open(args.out, "a", encoding="utf-8") as out:
        while ft.step < args.max_steps and full < args.steps:
            try:
                step = ft.start_step()
            except QuorumError as exc:  # the lighthouse lost: one line, exit 3
                print(exc, flush=True)
                os._exit(3)
            ran += 1
            loss = grads_of(model, step, args.replica_id)
            time.sleep(args.step_sleep)
            if ran == args.die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            live = ft.replicas.size
            ft.replicas.average_([p.grad for p in model.parameters()])
            if ft.commit():
                full = full + 1 if live == args.group_size else 0
                opt.step()
                out.write(json.dumps({"step": step, "live": live, "t": time.time(),
                                      "pid": os.getpid(),
                                      "loss": loss.item(), "digest": digest(model),
                                      "params": flat(model)}) + "\n")
                out.flush()
            opt.zero_grad()
    ft.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
