"""Step time of one layout, by walking the pipeline schedule's instruction lists.

``simulate`` prices every chunk's forward and backward on one micro-batch
(``costs.chunk_costs``: compute from ``compute``, the collectives inside it from
``comm_price``), walks the schedule with those costs (``schedule_walk``), then adds the
data-parallel gradient sync after the flush (ZeRO-0 all-reduce, ZeRO-1/2 reduce-scatter +
parameter all-gather; ZeRO-3's gathers and reduce-scatters are inside every micro-batch's
forward and backward: ``costs.zero3_seconds``), a tied embedding's all-reduce and the
optimizer; the step ends when the slowest rank is done (the global norm is one collective
over all ranks).

The time split reported, for the slowest rank: ``compute``, ``tp``, ``cp`` (ring traffic not
hidden behind attention), ``ep`` (all-to-all), ``pp`` (waiting on pipeline transfers beyond
the ideal bubble, and blocking sends), ``bubble`` (idle with free transfers), ``dp`` and
``optimizer``; they add up to ``step``.

The names of the pricing modules that tests and benchmarks import are importable from here
too (``__all__``: ``from shardwise.planner.simulate import block_ops``), as before the split.
"""

from __future__ import annotations

from typing import NamedTuple

from shardwise.parallel.pipeline.schedules import schedule
from shardwise.planner.comm_price import (
    DpSeconds,
    RingBytes,
    RingSeconds,
    all_to_all_bytes,
    all_to_all_seconds,
    blocking_p2p,
    dp_seconds,
    megatron_send_seconds,
    p2p_bytes,
    p2p_seconds,
    ring_bytes,
    ring_kv_width,
    ring_seconds,
    tied_seconds,
)
from shardwise.planner.compute import (
    Ops,
    attention_gemm_flops,
    attention_keys,
    block_flops,
    block_ops,
    op_seconds,
    optimizer_seconds,
    recomputed_ops,
)
from shardwise.planner.costs import (
    BlockCosts,
    ChunkCost,
    _with_zero3,
    block_costs,
    chunk_costs,
    model_seconds,
    unit_forward_seconds,
    zero3_seconds,
)
from shardwise.planner.feasible import check, prune_reason  # noqa: F401 (as before)
from shardwise.planner.hardware import Cluster
from shardwise.planner.layout import Layout
from shardwise.planner.memory import BYTES, stage_layers
from shardwise.planner.schedule_walk import _orders, _walk_fast_memo, walk, walk_fast, walk_shared
from shardwise.planner.specs import ModelSpec

__all__ = [  # this module's own, and the pricing names importable from here as before
    "Layout", "simulate", "RankComm",
    "DpSeconds", "RingBytes", "RingSeconds", "all_to_all_bytes", "all_to_all_seconds",
    "blocking_p2p", "dp_seconds", "megatron_send_seconds", "p2p_bytes", "p2p_seconds",
    "ring_bytes",
    "ring_kv_width", "ring_seconds", "tied_seconds",
    "Ops", "attention_gemm_flops", "attention_keys", "block_flops", "block_ops", "op_seconds",
    "optimizer_seconds", "recomputed_ops",
    "BlockCosts", "ChunkCost", "_with_zero3", "block_costs", "chunk_costs", "model_seconds",
    "unit_forward_seconds", "zero3_seconds",
    "_orders", "walk", "walk_fast",
]


class RankComm(NamedTuple):
    """Seconds one pipeline rank spends in communication inside its compute over a step
    (``_rank_comm``): m passes of each of its chunks."""

    cp: float
    """Seconds of exposed ring traffic."""
    ep: float
    """Seconds of all-to-alls."""
    pp: float
    """Seconds of blocking pipeline sends."""
    dp: float
    """Seconds of ZeRO-3's exposed collectives."""


def _rank_comm(costs: list[ChunkCost], r: int, lay: Layout) -> RankComm:
    """``RankComm(cp, ep, pp, dp)``: the exposed ring, all-to-all, blocking-send and ZeRO-3
    seconds rank ``r`` spends in the walk, m passes of each of its chunks."""
    mine = [c for i, c in enumerate(costs) if i % lay.pp == r]
    if not any(c.cp or c.ep or c.pp or c.dp for c in mine):
        return RankComm(0.0, 0.0, 0.0, 0.0)
    m = lay.micro_batches
    return RankComm(m * sum(c.cp for c in mine), m * sum(c.ep for c in mine),
                    m * sum(c.pp for c in mine), m * sum(c.dp for c in mine))


def simulate(spec: ModelSpec, layout: Layout, cluster: Cluster, precision: str | None = None,
             with_events: bool = False) -> dict:
    """Predicted seconds of one optimizer step (``"step"``) and its split (the module
    docstring), a dict of seconds; ``with_events``: also the timeline (``"events"``, one
    dict per compute). Raises ``ValueError`` naming the reason where ``feasible.prune_reason``
    rejects ``layout``, but for what it prunes as the same as another layout, priced as that
    one: ZeRO with dp x cp = 1 as ZeRO-0, FP8 on a GPU without it as bf16
    (``Layout.fp8``); tp may cross nodes here."""
    check(spec, layout, cluster)
    lay = layout
    precision = precision or cluster.precision
    kind = lay.schedule if lay.pp > 1 else "1f1b"
    shared = bool(cluster.cores)
    costs = chunk_costs(spec, lay, cluster, precision, dedicated=shared)
    e = BYTES[precision]
    p2p = p2p_seconds(spec, lay, cluster, e)
    fast = not shared and not with_events and kind in ("1f1b", "interleaved")
    p, m, v = lay.pp, lay.micro_batches, lay.chunks_per_rank
    if fast:  # the same numbers as walk(), without the instruction lists
        key = tuple(costs)
        run = lambda c: _walk_fast_memo(p, m, v, key, c)
    elif shared:
        sched = schedule(kind, p, m, v)
        # every pipeline rank's copies run its schedule at once: dp x cp x tp of them
        run = lambda c: walk_shared(sched, costs, c, cluster.cores, lay.world // lay.pp,
                                    cluster.contention)
    else:
        sched = schedule(kind, p, m, v)
        run = lambda c: walk(sched, costs, c)
    end, busy, tp_time, events = run(p2p)
    ideal_end = run(0.0).end if lay.pp > 1 else end
    per_rank = stage_layers(spec, lay.pp, lay.chunks_per_rank, lay.partition, kind)
    totals, parts = [], []
    for r in range(lay.pp):
        dp = dp_seconds(spec, lay, cluster, precision, per_rank[r])
        opt = optimizer_seconds(spec, lay, cluster, per_rank[r])
        tied = tied_seconds(spec, lay, cluster, precision, r)
        totals.append(end[r] + dp.after + tied + opt)
        comm = _rank_comm(costs, r, lay)
        parts.append({"compute": busy[r],
                      "tp": tp_time[r] - comm.cp - comm.ep - comm.pp - comm.dp,
                      "cp": comm.cp, "ep": comm.ep,
                      "pp": max(0.0, end[r] - ideal_end[r]) + comm.pp,
                      "dp": dp.after + comm.dp + tied, "optimizer": opt})
    # the split of the bottleneck stage (most compute); its idle time is the bubble
    star = max(range(lay.pp), key=lambda r: busy[r] + tp_time[r])
    step = max(totals)
    split = parts[star]
    split["bubble"] = step - sum(split.values())
    best = (step, split)
    out = {"step": best[0], **best[1]}
    if with_events:
        out["events"] = events
    return out
