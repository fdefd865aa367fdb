"""Benchmark hygiene on a shared machine: repeats disturbed by other processes are dropped.

On the 2-core development machine other work (a test suite, a build) often runs at the same
time as a benchmark, and a repeat during which another process held a core is slower for
reasons that have nothing to do with the algorithm. ``Foreign`` measures, for a timed
window, the CPU time used by every process except the benchmark's own ranks (Linux
``/proc/stat`` minus the ranks' ``/proc/PID/stat``; the kernel's softirq time, where
loopback TCP is processed, is left out on both sides), in cores: CPU seconds per wall
second. ``repeat_until_quiet`` runs repeats until enough of them saw less than
``threshold`` foreign cores, or a budget of tries is spent; rank 0 judges and tells the
others, so every rank runs the same number of repeats.

Elsewhere than Linux nothing can be measured and every repeat counts as quiet.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch
import torch.distributed as dist

THRESHOLD = 0.15  # foreign cores (CPU seconds per wall second) a quiet repeat may see


def _ticks() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def _busy_total() -> int | None:
    """user + nice + system jiffies of the whole machine (no idle, iowait, irq, softirq)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[1]) + int(fields[2]) + int(fields[3])
    except (OSError, IndexError, ValueError):
        return None


def _proc_cpu(pid: int) -> int:
    """utime + stime jiffies of process ``pid`` (all its threads); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[11]) + int(rest[12])
    except (OSError, IndexError, ValueError):
        return 0


class Foreign:
    """CPU used by processes other than ``pids`` during a window, in cores."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = list(pids)
        self.available = _busy_total() is not None
        self._start: tuple[float, int, int] | None = None

    def _ours(self) -> int:
        return sum(_proc_cpu(p) for p in self.pids)

    def start(self) -> None:
        """Open the window: note the time, the host's busy jiffies and those of ``pids``."""
        if self.available:
            self._start = (time.perf_counter(), _busy_total() or 0, self._ours())

    def stop(self) -> float:
        """Foreign cores since ``start`` (0.0 when nothing can be measured)."""
        if not self.available or self._start is None:
            return 0.0
        t0, busy0, ours0 = self._start
        wall = max(time.perf_counter() - t0, 1e-3)
        foreign = ((_busy_total() or 0) - busy0) - (self._ours() - ours0)
        return max(0.0, foreign / _ticks() / wall)


def rank_pids(group=None) -> list[int]:
    """The process ids of every rank of the (local) group, gathered on every rank."""
    pids: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(pids, os.getpid(), group=group)
    return [int(p) for p in pids]


def repeat_until_quiet(one_repeat: Callable[[int], None], repeats: int, max_tries: int,
                       foreign: Foreign | None, threshold: float = THRESHOLD) -> list[float]:
    """Call ``one_repeat(i)`` for i = 0, 1, ... until ``repeats`` calls were quiet (foreign
    load below ``threshold`` cores) or ``max_tries`` calls were made; collective.

    Returns the foreign load seen by each call (measured on rank 0, the same list on
    every rank). ``foreign=None`` on other ranks than 0 is fine.
    """
    loads: list[float] = []
    flag = torch.zeros(2, dtype=torch.float64)
    rank0 = dist.get_rank() == 0
    i = 0
    while True:
        if rank0 and foreign is not None:
            foreign.start()
        one_repeat(i)
        i += 1
        if rank0:
            load = foreign.stop() if foreign is not None else 0.0
            quiet = sum(x < threshold for x in loads) + (load < threshold)
            flag[0], flag[1] = load, float(quiet >= repeats or i >= max_tries)
        dist.broadcast(flag, 0)
        loads.append(float(flag[0]))
        if flag[1] > 0:
            return loads


def quiet_values(values: list[float], loads: list[float], threshold: float = THRESHOLD,
                 least: int = 3) -> list[float]:
    """The values of quiet repeats, or all of them if fewer than ``least`` were quiet."""
    kept = [v for v, x in zip(values, loads) if x < threshold]
    return kept if len(kept) >= least else list(values)
