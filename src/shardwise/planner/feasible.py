"""Why a layout cannot run (or is not worth pricing): the reasons the planner's search
prunes with (``prune_reason``), each one line naming the size at fault, and that
``simulate`` refuses a layout with."""

from __future__ import annotations

from shardwise.base.config import split_backward_refusal
from shardwise.planner.hardware import Cluster
from shardwise.planner.layout import Layout
from shardwise.planner.specs import ModelSpec


def tp_reason(spec: ModelSpec, tp: int, cluster: Cluster, tp_across_nodes: bool) -> str | None:
    """The reasons of ``prune_reason`` that depend on tp alone."""
    for what, n in spec.tp_divides:
        if n % tp:
            return f"tp={tp} does not divide {what} = {n}"
    if not spec.tp_divides and spec.n_head % tp:
        return f"tp={tp} does not divide the {spec.n_head} heads"
    if not spec.tp_divides and spec.kv_heads % tp:
        return f"tp={tp} does not divide the {spec.kv_heads} key/value heads"
    if not spec.tp_divides and spec.ffn % tp:
        return f"tp={tp} does not divide the MLP width {spec.ffn}"
    if tp > cluster.gpus_per_node and not tp_across_nodes:
        return f"tp={tp} would cross nodes of {cluster.gpus_per_node} GPUs"
    return None


def cp_reason(spec: ModelSpec, cp: int) -> str | None:
    """The reasons that hold for every layout of one cp size: 2 cp must divide the
    sequence, and a model whose description runs no context parallelism
    (``ModelDescription.context_parallel`` false; the Llama's with DeepSeek's MLA or Gemma
    2's soft-capped scores run it by the all-to-all only: ``search.cp_a2a_choices``) or
    with dropout gets no cp > 1 (the engine refuses both:
    ``Engine``'s and ``base.config``'s cp checks; ring attention has no dropout)."""
    d = spec.description
    if cp > 1 and d is not None and not d.context_parallel:
        return (f"cp={cp}: model {spec.name!r} does not run under context parallelism "
                "(its ModelDescription.context_parallel is false; the engine refuses cp > 1)")
    if cp > 1 and spec.dropout > 0:
        return (f"cp={cp} with model.dropout={spec.dropout:g}: ring attention has no "
                "attention dropout (the engine refuses cp > 1 with dropout)")
    if cp > 1 and spec.block_size % (2 * cp):
        return (f"cp={cp}: 2 x cp = {2 * cp} does not divide the sequence {spec.block_size} "
                "(each cp rank holds chunks i and 2cp-1-i)")
    return None


def chunks_reason(spec: ModelSpec, pp: int, v: int) -> str | None:
    """Why ``pp`` x ``v`` pipeline chunks cannot be cut from the model's layers (the
    blocks, the embedding and the head), or None."""
    if pp * v > spec.n_layer + 2:
        return f"{pp * v} pipeline chunks for {spec.n_layer + 2} layers"
    return None


def prune_reason(spec: ModelSpec, lay: Layout, cluster: Cluster,
                 tp_across_nodes: bool) -> str | None:
    """Why the engine cannot run ``lay`` (or the cluster cannot hold it), or None. The sizes
    tp must divide: a described model's own (``ModelSpec.tp_divides``, what the engine
    checks), else the heads, key/value heads and MLP width."""
    why = tp_reason(spec, lay.tp, cluster, tp_across_nodes) or chunks_reason(
        spec, lay.pp, lay.chunks_per_rank) or cp_reason(spec, lay.cp)
    if not why and lay.fp8 and cluster.fp8_flops is None:
        why = fp8_reason(cluster)
    return why or layout_reason(spec, lay)


def fp8_reason(cluster: Cluster) -> str:
    """The reason FP8 layouts are pruned on a cluster without FP8 tensor cores."""
    return f"fp8 on {cluster.name}: the {cluster.gpu} has no FP8 tensor cores"


def micro_batches_reason(kind: str, pp: int, m: int) -> str | None:
    """Why schedule ``kind`` cannot run ``m`` micro-batches over ``pp`` stages, or None."""
    if kind == "interleaved" and m % pp:
        return f"interleaved needs micro-batches m={m} divisible by pp={pp}"
    if kind == "dualpipev" and m < 2 * pp:
        return f"dualpipev needs micro-batches m={m} >= 2 pp = {2 * pp}"
    return None


def layout_reason(spec: ModelSpec, lay: Layout) -> str | None:
    """The reasons of ``prune_reason`` beyond tp's and the chunk count."""
    why = micro_batches_reason(lay.schedule, lay.pp, lay.micro_batches)
    if why:
        return why
    mode = ("selective" if lay.selective or lay.recompute == "selective" else
            "full" if lay.recompute == "full" else "stage" if lay.recompute else "none")
    refusal = split_backward_refusal(lay.schedule, lay.zero, mode)
    if refusal:  # the config's own line
        return refusal
    if lay.sp and (spec.block_size // lay.cp) % lay.tp:
        return (f"sequence parallelism: tp={lay.tp} does not divide the sequence "
                f"{spec.block_size // lay.cp}" + (" (per cp rank)" if lay.cp > 1 else ""))
    if lay.ep > 1 and (not spec.moe or lay.dp % lay.ep or spec.n_experts % lay.ep):
        return (f"ep={lay.ep} must divide dp={lay.dp} and the experts "
                f"({spec.n_experts})")
    if lay.zero and lay.dp * lay.cp == 1:
        return "ZeRO with dp=1 shards nothing (same as ZeRO-0)"
    if lay.dp_replicate > 1 and (lay.dp % lay.dp_replicate or not lay.zero):
        return (f"HSDP: dp_replicate={lay.dp_replicate} must divide dp={lay.dp}, with ZeRO "
                "1-3 (ZeRO-0's all-reduce over dp is the same at every split)")
    if lay.selective and lay.recompute:
        return "selective and full recomputation together (full recomputes everything)"
    if lay.recompute == "selective" and spec.moe:
        return SELECTIVE_MOE
    return None


SELECTIVE_MOE = ("selective recomputation with a mixture of experts: what it keeps (the "
                 "experts' grouped matmuls, the all-to-alls' rows) is not modelled")
