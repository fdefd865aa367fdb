"""Pipeline parallelism: schedules as data, a checker, partitioning, one executor, timelines.

- ``schedules``: ``schedule(kind, p, m, v)`` -> ``Schedule`` (instruction lists per rank)
  for naive, GPipe, 1F1B, interleaved 1F1B and PipeDream; ``simulate`` for ideal timings.
- ``check``: ``check(schedule)`` validates any schedule without processes.
"""

from shardwise.pipeline.check import CheckReport, check
from shardwise.pipeline.schedules import (KINDS, Backward, Forward, OptimizerStep,
                                          RecvActivation, RecvGrad, Schedule, ScheduleError,
                                          SendActivation, SendGrad, compute_order, ideal_bubble,
                                          schedule, simulate)

__all__ = [
    "KINDS", "Schedule", "ScheduleError", "schedule", "compute_order", "simulate", "ideal_bubble",
    "Forward", "Backward", "SendActivation", "RecvActivation", "SendGrad", "RecvGrad",
    "OptimizerStep", "check", "CheckReport",
]
