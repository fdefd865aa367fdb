"""What a synchronisation costs when ranks outnumber cores (this machine), measured.

With N ranks on c < N cores, a rank that waits in a collective gives up its core; when its
peer's data arrives it must wait to be scheduled again, behind ranks that are computing.
The comm profile (``shardwise.cli.calibrate``) times collectives with every rank taking part and
nobody computing, so it does not see this. ``calibrate_sync_penalty(N)`` spawns N ranks
(one thread each) that alternate a fixed amount of matmul work with a small all-reduce in
pairs (as tensor-parallel ranks do), and the same work without the all-reduce, 5 times
back to back; the penalty is the least extra seconds per round of a pair of runs (other
processes only add time), beyond the profile's price of that all-reduce. The
simulator adds it to every collective and pipeline transfer when N > cores.
"""

from __future__ import annotations

import os
import statistics
import time
from functools import lru_cache
from typing import TYPE_CHECKING

from shardwise.comm import cost

if TYPE_CHECKING:
    import torch

ROUNDS, MSG_FLOATS = 40, 16384


def _work(a: torch.Tensor, b: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        a @ b


def sync_worker(reps: int) -> dict:
    """Rank function of ``calibrate_sync_penalty``: ``reps`` matmuls per round, with and without a
    small all-reduce in pairs, 5 times each; returns the seconds per round of each (``alone``,
    ``sync``: lists of 5)."""
    import torch  # here, not at the top: a named model's plan imports no torch
    import torch.distributed as dist

    from shardwise import comm

    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([2 * k, 2 * k + 1]) for k in range(n // 2)]
    group = pairs[rank // 2]
    a, b, x = torch.randn(256, 128), torch.randn(128, 512), torch.ones(MSG_FLOATS)
    out = {"alone": [], "sync": []}
    for _ in range(5):
        for kind in ("alone", "sync"):
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(ROUNDS):
                _work(a, b, reps)
                if kind == "sync":
                    comm.all_reduce(x, group=group)
            out[kind].append((time.perf_counter() - t0) / ROUNDS)
    return out


@lru_cache(maxsize=8)
def calibrate_sync_penalty(world_size: int) -> float:
    """Seconds a synchronisation costs beyond its comm-profile price at ``world_size``
    ranks on this machine's cores (0 when every rank has a core)."""
    cores = os.cpu_count() or 1
    if world_size <= cores or world_size % 2:
        return 0.0
    from shardwise.launch import spawn

    res = spawn(sync_worker, world_size, (8,), threads=1)
    # the least extra of 5 back-to-back pairs per rank (other processes only add time, as
    # the fastest-step measurement of benchmarks/planner_local.py assumes), median over ranks
    extra = statistics.median(min(s - a for s, a in zip(r["sync"], r["alone"])) for r in res)
    price = cost.predict("native", 2, MSG_FLOATS * 4, cost.active_profile().params(2))
    return max(0.0, extra - price)
