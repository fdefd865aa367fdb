"""Search over layouts: enumerate, prune with a reason, simulate, rank.

The space: every dp x tp x pp = world size, micro-batch size (a divisor of the global
batch per replica), schedule (1F1B; interleaved with v = 2, 4 where the layers allow),
ZeRO 0-3 (3 only without a pipeline, as the engine requires), recomputation on/off,
sequence parallelism on/off (tp > 1), stage cut by layer count or by parameters (pp > 1). Tensor parallelism stays inside a node unless
``tp_across_nodes``. Each pruned layout keeps its reason (``Pruned``); the feasible ones
are ranked by the simulator's predicted step time (``simulate.simulate``); with many
candidates an analytic pre-rank (the same chunk costs with the textbook bubble) keeps the
best ``simulate_top`` for the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.planner.hardware import Cluster
from shardwise.planner.memory import GiB, activation_bytes, static_bytes
from shardwise.planner.simulate import Layout, chunk_costs, simulate
from shardwise.planner.specs import ModelSpec


@dataclass
class Candidate:
    layout: Layout
    memory: dict          # params, grads, optimizer, activations, total (bytes per GPU)
    time: dict = field(default_factory=dict)  # simulate()'s split; "step" seconds


@dataclass
class Pruned:
    layout: Layout
    reason: str
    need: float | None = None  # bytes per GPU, when pruned for memory


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(spec: ModelSpec, world: int, global_batch: int, *,
                      micro_batches: list[int] | None = None, zero: list[int] = (0, 1, 2, 3),
                      recompute: list[bool] = (False, True), sp: list[bool] = (False, True),
                      schedules: list[str] = ("1f1b", "interleaved"), vs: list[int] = (2, 4),
                      pp_max: int | None = None, partitions: list[str] = ("layers", "params")):
    """Yield every layout of the space (feasible or not)."""
    for tp in divisors(world):
        for pp in divisors(world // tp):
            if pp_max and pp > pp_max:
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                yield Layout(dp, tp, pp, 0, 0), f"global batch {global_batch} is not divisible by dp={dp}"
                continue
            per = global_batch // dp
            for mb in (micro_batches or divisors(per)):
                if per % mb:
                    continue
                m = per // mb
                scheds = [("1f1b", 1)] if pp == 1 else [("1f1b", 1)] + (
                    [("interleaved", v) for v in vs] if "interleaved" in schedules else [])
                for kind, v in scheds:
                    for z in zero:
                        for rc in recompute:
                            for s in (sp if tp > 1 else (False,)):
                                for cut_by in (partitions if pp > 1 else ("layers",)):
                                    yield Layout(dp, tp, pp, mb, m, kind, v, z, rc, s,
                                                 cut_by), None


def prune_reason(spec: ModelSpec, lay: Layout, cluster: Cluster, tp_across_nodes: bool) -> str | None:
    """Why the engine cannot run ``lay`` (or the cluster cannot hold it), or None. The sizes
    tp must divide: a described model's own (``ModelSpec.tp_divides``, what the engine
    checks), else the heads, key/value heads and MLP width."""
    for what, n in spec.tp_divides:
        if n % lay.tp:
            return f"tp={lay.tp} does not divide {what} = {n}"
    if not spec.tp_divides and spec.n_head % lay.tp:
        return f"tp={lay.tp} does not divide the {spec.n_head} heads"
    if not spec.tp_divides and spec.kv_heads % lay.tp:
        return f"tp={lay.tp} does not divide the {spec.kv_heads} key/value heads"
    if not spec.tp_divides and spec.ffn % lay.tp:
        return f"tp={lay.tp} does not divide the MLP width {spec.ffn}"
    if lay.tp > cluster.gpus_per_node and not tp_across_nodes:
        return f"tp={lay.tp} would cross nodes of {cluster.gpus_per_node} GPUs"
    if lay.pp * lay.chunks_per_rank > spec.n_layer + 2:
        return f"{lay.pp * lay.chunks_per_rank} pipeline chunks for {spec.n_layer + 2} layers"
    if lay.zero == 3 and lay.pp > 1:
        return "ZeRO-3 with pipeline parallelism (the engine refuses it, as DeepSpeed)"
    if lay.schedule == "interleaved" and lay.micro_batches % lay.pp:
        return f"interleaved needs micro-batches m={lay.micro_batches} divisible by pp={lay.pp}"
    if lay.sp and spec.block_size % lay.tp:
        return f"sequence parallelism: tp={lay.tp} does not divide the sequence {spec.block_size}"
    if lay.zero and lay.dp == 1:
        return "ZeRO with dp=1 shards nothing (same as ZeRO-0)"
    return None


def memory_of(spec: ModelSpec, lay: Layout, precision: str) -> dict:
    st = static_bytes(spec, lay.dp, lay.tp, lay.pp, lay.chunks_per_rank, lay.zero, precision,
                      lay.sp, partition=lay.partition)
    act = activation_bytes(spec, mb=lay.micro_batch_size, tp=lay.tp, pp=lay.pp,
                           micro_batches=lay.micro_batches, v=lay.chunks_per_rank,
                           schedule=lay.schedule, sp=lay.sp, recompute=lay.recompute,
                           precision=precision, partition=lay.partition)
    return {**st, "activations": act, "total": st["total"] + act}


def quick_estimate(spec: ModelSpec, lay: Layout, cluster: Cluster, precision: str) -> float:
    """Analytic step time: chunk costs x (v m + p - 1) per rank (the textbook bubble)."""
    costs = chunk_costs(spec, lay, cluster, precision)
    per_chunk = max(c[0] + c[1] for c in costs)
    return per_chunk * (lay.chunks_per_rank * lay.micro_batches + lay.pp - 1)


def plan(spec: ModelSpec, cluster: Cluster, world: int, global_batch: int, *,
         precision: str | None = None, memory_limit: float | None = None,
         tp_across_nodes: bool = False, simulate_top: int = 40, **space) -> tuple[list, list]:
    """``(feasible ranked by predicted step time, pruned with reasons)``."""
    precision = precision or cluster.precision
    limit = memory_limit or cluster.memory_per_rank(world)
    feasible, pruned = [], []
    for lay, why in enumerate_layouts(spec, world, global_batch, **space):
        why = why or prune_reason(spec, lay, cluster, tp_across_nodes)
        if why:
            pruned.append(Pruned(lay, why))
            continue
        mem = memory_of(spec, lay, precision)
        if mem["total"] > limit:
            pruned.append(Pruned(lay, f"needs {mem['total'] / GiB:.3g} GiB per GPU, more "
                                      f"than the {limit / GiB:.3g} GiB it has", mem["total"]))
            continue
        feasible.append(Candidate(lay, mem))
    if len(feasible) > simulate_top:
        feasible.sort(key=lambda c: quick_estimate(spec, c.layout, cluster, precision))
        feasible = feasible[:simulate_top]
    for c in feasible:
        c.time = simulate(spec, c.layout, cluster, precision)
    feasible.sort(key=lambda c: (c.time["step"], c.memory["total"]))
    return feasible, pruned


def smallest_need(pruned: list[Pruned]) -> float | None:
    """The least memory per GPU any layout pruned only for memory needs (bytes)."""
    need = [p.need for p in pruned if p.need is not None]
    return min(need) if need else None
