"""Pipeline parallelism: schedules as data, a checker, partitioning, one executor, timelines.

- ``schedules``: ``schedule(kind, p, m, v)`` -> ``Schedule`` (instruction lists per rank)
  for naive, GPipe, 1F1B, interleaved 1F1B, PipeDream and the zero-bubble ZB-H1 (``zb1p``),
  ZB-V (``zbv``) and DualPipeV (``dualpipev``); ``time_orders`` for ideal timings.
- ``split_backward``: a chunk's backward in two, B (input gradient) and W (weights).
- ``check``: ``check(schedule)`` validates any schedule without processes.
- ``partition``: balanced contiguous cuts by layer count, parameters or profiled time.
- ``stage``: GPT chunks keeping the GPT's parameter names.
- ``executor``: runs one rank's list with non-blocking p2p through ``shardwise.comm``.
- ``timeline``: record, predict, measure the idle fraction, draw the Gantt chart;
  ``shardwise.cli.timeline`` is the command.

The training step that runs a schedule with dp, tp and ZeRO is ``shardwise.engine``.
See ``docs/pipeline.md``.
"""

from shardwise.base.lazy import lazy_exports
from shardwise.parallel.pipeline.bubble import ideal_bubble
from shardwise.parallel.pipeline.check import CheckReport, check
from shardwise.parallel.pipeline.schedules import (
                                          KINDS,
                                          Backward,
                                          BackwardInput,
                                          BackwardWeight,
                                          Forward,
                                          OptimizerStep,
                                          RecvActivation,
                                          RecvGrad,
                                          Schedule,
                                          ScheduleError,
                                          SendActivation,
                                          SendGrad,
                                          compute_order,
                                          schedule,
                                          time_orders,
)

# the schedules, their checker and the bubble (above) import no torch; the rest loads on first
# use (public name -> its submodule), so the planner's ``partition.balanced`` imports none
_EXPORTS: dict[str, str] = {
    "Executor": "executor",
    **dict.fromkeys(["Partition", "PartitionError", "balanced", "gpt_layers",
                     "partition_layers", "profile_layers"], "partition"),
    **dict.fromkeys(["StageChunk", "gpt_chunks", "lm_loss"], "stage"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "KINDS", "Schedule", "ScheduleError", "schedule", "compute_order", "time_orders",
    "ideal_bubble",
    "Forward", "Backward", "BackwardInput", "BackwardWeight", "SendActivation", "RecvActivation",
    "SendGrad", "RecvGrad",
    "OptimizerStep", "check", "CheckReport", "Partition", "PartitionError", "balanced",
    "gpt_layers", "partition_layers", "profile_layers", "StageChunk", "gpt_chunks", "lm_loss",
    "Executor",
]
