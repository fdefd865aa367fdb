"""The textbook idle fraction of each schedule, for tests, benchmarks and the planner."""

from __future__ import annotations

from shardwise.base.config import SPLIT_BACKWARD_KINDS
from shardwise.parallel.pipeline.schedules import compute_order, time_orders
from shardwise.parallel.pipeline.stream import steady_bubble


def ideal_bubble(kind: str, p: int, m: int, v: int = 1) -> float:
    """Textbook idle fraction: ``(p-1)/(m+p-1)``, interleaved ``(p-1)/(v m + p - 1)``,
    naive ``(p-1)/p``; PipeDream: a steady-state step of its stream, which has no fill or
    drain but starts together on all ranks after the trainer's loss broadcast
    (``stream.steady_bubble``). Zero-bubble kinds (greedy orders, no closed form): their
    compute orders timed with F = B = W (``time_orders``, backward twice the forward)."""
    if kind in SPLIT_BACKWARD_KINDS:
        times = time_orders(compute_order(kind, p, m, v), p, v, forward_cost=1.0 / v)
        span = max(e for _, e in times.values())
        return 1.0 - sum(e - s for s, e in times.values()) / (p * span)
    if kind == "naive":
        return (p - 1) / p
    if kind == "pipedream":
        return steady_bubble(p, m)
    if kind == "interleaved":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)
