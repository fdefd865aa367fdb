"""``shardwise train`` as a one-rank job in this process (torchrun's environment, world size
1), with two test hooks, for a replica group of a torchft job:

    python tests/ft_train.py --go FILE --slow-save S -- train --config ... [overrides]

``--go FILE``: the first quorum waits until FILE exists (the test creates it once every
replica group is up, so all are in the first quorum). ``--slow-save S``: each checkpoint
write of a step below ``--slow-below`` (every step by default) takes S seconds more (a
slow disk). ``--perturb X``: X added to every parameter once the trainer is built (a group
that starts from other weights: what the replicas' comparison at a new quorum must find)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

WAIT_S = 120  # bound of the wait for the go file


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--go", default="")
    ap.add_argument("--slow-save", type=float, default=0.0)
    ap.add_argument("--slow-below", type=int, default=2**62)
    ap.add_argument("--perturb", type=float, default=0.0)
    ap.add_argument("argv", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from shardwise import checkpoint
    from shardwise.cli.main import main as shardwise_main
    from shardwise.training.fault_tolerance import FaultTolerantReplica

    if args.go:
        first = FaultTolerantReplica.start_step

        def gated(self):
            deadline = time.monotonic() + WAIT_S
            while not os.path.exists(args.go) and time.monotonic() < deadline:
                time.sleep(0.02)
            FaultTolerantReplica.start_step = first
            return first(self)

        FaultTolerantReplica.start_step = gated
    if args.slow_save:
        save = checkpoint.save

        def slow(directory, step, *a, **kw):
            if step < args.slow_below:
                time.sleep(args.slow_save)
            return save(directory, step, *a, **kw)

        checkpoint.save = slow
    if args.perturb:
        import torch

        from shardwise.apps.lm.trainer import Trainer

        init = Trainer.__init__

        def perturbed(self, *a, **kw):
            init(self, *a, **kw)
            with torch.no_grad():
                for _, p in self.engine.named_parameters():
                    p.add_(args.perturb)

        Trainer.__init__ = perturbed
    with socket.socket() as s:  # a free port for the one-rank process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    sys.exit(shardwise_main(argv))


if __name__ == "__main__":
    main()
