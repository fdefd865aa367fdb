"""What a synchronisation costs when ranks outnumber cores (this machine), measured.

With N ranks on c < N cores, a rank that waits in a collective gives up its core; when its
peers' data arrives it must wait to be scheduled again, behind ranks that are computing.
The comm profile (``shardwise.cli.calibrate``) times collectives with every rank taking
part and nobody computing, so it does not see this. What the wait comes to may depend on
the step's shape rather than on the call alone: how many ranks synchronise together (a
group of g ranks, N / g such groups computing at once) and how much work each rank does
between two synchronisations (a tensor-parallel block's few hundred microseconds, or a
whole step's before a gradient sync), so it is measured per group size and work.

``calibrate_sync_penalty(N)`` spawns N ranks (one thread each) in N / g groups of g ranks
for every g of ``group_sizes(N)``; at each of ``WORK_S`` seconds of matmul work per round
(a dedicated core's seconds) they alternate rounds of that work with a small all-reduce
inside their group, and the same work without it, back to back until ``REPEATS`` such
pairs saw no other process's load (``comm.quiet``). The wait of one synchronisation is the
fastest synchronised run's seconds per round less the fastest unsynchronised one's (other
processes only add time), the median over ranks, beyond the planner's price
of that all-reduce among the N ranks (gloo's own, the profile at g ranks stretched as CPU
work shared by the N: ``Cluster.comm_stretch``). ``SyncPenalty`` holds the
table and prices a synchronisation of a group of g ranks after w seconds of work,
interpolating in log w between the measured works (the nearest end beyond them).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

from shardwise.comm import cost

if TYPE_CHECKING:
    import torch

MSG_FLOATS = 16384  # 64 KB: a tensor-parallel activation of these benchmarks' micro-batches
WORK_S = (3e-4, 3e-3)  # seconds of work between synchronisations (one core), measured at
ROUNDS, REPEATS = 10, 3
MATMUL = (128, 128, 512)  # one unit of work: (m, k, n) fp32, ~0.2 ms on one core here


class SyncPenalty(NamedTuple):
    """The measured wait of one synchronisation (``calibrate_sync_penalty``): ``rows`` of
    (group size g, seconds of work between synchronisations, seconds waited), ascending;
    empty: none (every rank has a core, or a GPU cluster)."""

    rows: tuple[tuple[int, float, float], ...] = ()

    def __call__(self, group: int, work_s: float) -> float:
        """Seconds one synchronisation of ``group`` ranks waits after ``work_s`` seconds of
        work (a dedicated core's), log-interpolated in the work between the rows of the
        measured group size nearest ``group`` (ties: the larger); 0 for one rank or no rows."""
        if group <= 1 or not self.rows:
            return 0.0
        sizes = sorted({g for g, _, _ in self.rows})
        g = min(sizes, key=lambda s: (abs(math.log(s / group)), -s))
        pts = [(w, s) for gg, w, s in self.rows if gg == g]
        if work_s <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        if work_s >= pts[-1][0]:
            return pts[-1][1]
        for (w0, s0), (w1, s1) in zip(pts, pts[1:]):
            if w0 <= work_s <= w1:
                f = math.log(work_s / w0) / math.log(w1 / w0)
                return s0 + f * (s1 - s0)
        return pts[-1][1]


def group_sizes(world_size: int) -> list[int]:
    """The group sizes measured at ``world_size`` ranks: its divisors from 2 up (every tp
    and dp group of a layout has one of these sizes)."""
    return [g for g in range(2, world_size + 1) if world_size % g == 0]


def _reps_per_second() -> float:
    """Units of ``MATMUL`` one core runs per second (the fastest of 5 timings)."""
    import torch

    m, k, n = MATMUL
    a, b = torch.randn(m, k), torch.randn(k, n)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20):
            a @ b
        best = min(best, (time.perf_counter() - t0) / 20)
    return 1.0 / best


def sync_worker(sizes: list[int], works: list[float]) -> dict:
    """Rank function of ``calibrate_sync_penalty``: per group size g of ``sizes`` and work
    of ``works`` (seconds), ``REPEATS`` runs of ``ROUNDS`` rounds with and without an
    all-reduce in the rank's group of g; returns ``{(g, w): {"alone": [...], "sync": [...]}}``
    seconds per round, and the units of work per second rank 0 measured (``"rate"``)."""
    import torch  # here, not at the top: a named model's plan imports no torch
    import torch.distributed as dist

    from shardwise import comm
    from shardwise.comm import quiet

    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    pids = quiet.rank_pids()  # collective
    foreign = quiet.Foreign(pids) if rank == 0 else None
    rate = torch.tensor([_reps_per_second() if rank == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(rate, 0)  # every rank runs the same number of units
    m, k, nn = MATMUL
    a, b, x = torch.randn(m, k), torch.randn(k, nn), torch.ones(MSG_FLOATS)
    out: dict = {"rate": float(rate)}
    for g in sizes:
        groups = [dist.new_group(list(range(j * g, (j + 1) * g))) for j in range(n // g)]
        group = groups[rank // g]
        for w in works:
            reps = max(1, round(w * float(rate)))
            runs: dict = {"alone": [], "sync": []}

            def pair(i: int) -> None:
                for kind in ("alone", "sync"):
                    comm.barrier()
                    t0 = time.perf_counter()
                    for _ in range(ROUNDS):
                        for _ in range(reps):
                            a @ b
                        if kind == "sync":
                            comm.all_reduce(x, group=group)
                    runs[kind].append((time.perf_counter() - t0) / ROUNDS)

            # pairs until REPEATS saw no other process's load (at most 2 x REPEATS); the
            # quiet ones kept, or every one when none was quiet
            loads = quiet.repeat_until_quiet(pair, REPEATS, 2 * REPEATS, foreign)
            out[(g, w)] = {k: quiet.quiet_values(v, loads, least=1) for k, v in runs.items()}
    return out


def penalty_rows(res: list[dict], sizes: list[int], works: list[float],
                 price) -> tuple[tuple[int, float, float], ...]:
    """``SyncPenalty.rows`` from ``sync_worker``'s results ``res`` (one dict per rank): per
    (g, w), the median over ranks of a rank's fastest synchronised run less its fastest
    unsynchronised one, less ``price(g)`` (the planner's price of the all-reduce), at
    least 0."""
    rows = []
    for g in sizes:
        for w in works:
            extra = statistics.median(min(r[(g, w)]["sync"]) - min(r[(g, w)]["alone"])
                                      for r in res)
            rows.append((g, w, max(0.0, extra - price(g))))
    return tuple(rows)


@lru_cache(maxsize=8)
def calibrate_sync_penalty(world_size: int) -> SyncPenalty:
    """The wait of a synchronisation at ``world_size`` ranks on this machine's cores, per
    group size and work between synchronisations (``SyncPenalty``; empty when every rank
    has a core)."""
    cores = os.cpu_count() or 1
    if world_size <= cores:
        return SyncPenalty()
    from shardwise.launch import spawn

    sizes, works = group_sizes(world_size), list(WORK_S)
    res = spawn(sync_worker, world_size, (sizes, works), threads=1)
    prof = cost.active_profile()

    def price(g: int) -> float:  # the all-reduce run (gloo's own, as tensor-parallel
        # layers call it) as the planner prices it among world_size ranks on the cores: the
        # profile's price (hardware.Link.all_reduce, tp=True) stretched as CPU work shared
        # with them (hardware.Cluster.comm_stretch)
        stretch = min(1.0, cores / g) * max(1.0, world_size / cores)
        return cost.predict("native", g, MSG_FLOATS * 4, prof.params(g)) * stretch

    return SyncPenalty(penalty_rows(res, sizes, works, price))
