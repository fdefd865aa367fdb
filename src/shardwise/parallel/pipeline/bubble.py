"""The textbook idle fraction of each schedule, for tests, benchmarks and the planner."""

from __future__ import annotations

from shardwise.parallel.pipeline.stream import steady_bubble


def ideal_bubble(kind: str, p: int, m: int, v: int = 1) -> float:
    """Textbook idle fraction: ``(p-1)/(m+p-1)``, interleaved ``(p-1)/(v m + p - 1)``,
    naive ``(p-1)/p``; PipeDream: a steady-state step of its stream, which has no fill or
    drain but starts together on all ranks after the trainer's loss broadcast
    (``stream.steady_bubble``)."""
    if kind == "naive":
        return (p - 1) / p
    if kind == "pipedream":
        return steady_bubble(p, m)
    if kind == "interleaved":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)
