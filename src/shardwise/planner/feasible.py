"""Why a layout cannot run (or is not worth pricing): the reasons the planner's search
prunes with (``prune_reason``), each one line naming the size at fault, and that
``simulate`` refuses a layout with."""

from __future__ import annotations

from dataclasses import replace

from shardwise.base.config import (
    SCHEDULE_KINDS,
    chunks_refusal,
    expert_refusal,
    micro_batches_refusal,
    pipeline_chunks_refusal,
    sequence_refusal,
    split_backward_refusal,
)
from shardwise.planner.hardware import Cluster
from shardwise.planner.layout import Layout
from shardwise.planner.specs import ModelSpec


def tp_reason(spec: ModelSpec, tp: int, cluster: Cluster | None,
              tp_across_nodes: bool) -> str | None:
    """The reasons of ``prune_reason`` that depend on tp alone (``cluster`` None: not the
    node's size)."""
    for what, n in spec.tp_divides:
        if n % tp:
            return f"tp={tp} does not divide {what} = {n}"
    if not spec.tp_divides and spec.n_head % tp:
        return f"tp={tp} does not divide the {spec.n_head} heads"
    if not spec.tp_divides and spec.kv_heads % tp:
        return f"tp={tp} does not divide the {spec.kv_heads} key/value heads"
    if not spec.tp_divides and spec.ffn % tp:
        return f"tp={tp} does not divide the MLP width {spec.ffn}"
    if cluster is not None and tp > cluster.gpus_per_node and not tp_across_nodes:
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
    return sequence_refusal(spec.block_size, cp, 1, False)


def chunks_reason(spec: ModelSpec, pp: int, v: int) -> str | None:
    """Why ``pp`` x ``v`` pipeline chunks cannot be cut from the model's layers (the
    blocks, the embedding and the head), or None: the config's rule and line."""
    return pipeline_chunks_refusal(pp, v, spec.n_layer)


def prune_reason(spec: ModelSpec, lay: Layout, cluster: Cluster | None,
                 tp_across_nodes: bool) -> str | None:
    """Why the engine cannot run ``lay`` (or the cluster cannot hold it), or None. The sizes
    tp must divide: a described model's own (``ModelSpec.tp_divides``, what the engine
    checks), else the heads, key/value heads and MLP width."""
    why = tp_reason(spec, lay.tp, cluster, tp_across_nodes) or chunks_reason(
        spec, lay.pp, lay.chunks_per_rank) or cp_reason(spec, lay.cp)
    if not why and lay.fp8 and cluster is not None and cluster.fp8_flops is None:
        why = fp8_reason(cluster)
    return why or layout_reason(spec, lay)


def fp8_reason(cluster: Cluster) -> str:
    """The reason FP8 layouts are pruned on a cluster without FP8 tensor cores."""
    return f"fp8 on {cluster.name}: the {cluster.gpu} has no FP8 tensor cores"


SIZES = ("dp", "tp", "pp", "micro_batch_size", "micro_batches", "chunks_per_rank", "cp",
         "ep", "dp_replicate", "cp_a2a")


def shape_reason(lay: Layout) -> str | None:
    """Why ``lay`` names no layout at all (a size below 1, an unknown ZeRO stage, schedule
    or cut, chunks the schedule does not run, an all-to-all degree that does not divide
    cp), or None: what every public planner function refuses (``check``)."""
    for f in SIZES:
        n = getattr(lay, f)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return f"{f}={n!r}: expected an integer >= 1"
    if lay.zero not in (0, 1, 2, 3):
        return f"zero={lay.zero!r}: expected a ZeRO stage 0-3"
    if lay.schedule not in SCHEDULE_KINDS:
        return f"schedule {lay.schedule!r}: expected one of {', '.join(SCHEDULE_KINDS)}"
    if lay.partition not in ("layers", "params"):
        return f"partition {lay.partition!r}: expected layers or params"
    if lay.pp > 1 and lay.schedule == "interleaved" and lay.chunks_per_rank < 2:
        return f"interleaved with chunks_per_rank={lay.chunks_per_rank}: needs 2 or more"
    if chunks_refusal(lay.schedule, lay.chunks_per_rank):  # the config's own line
        return chunks_refusal(lay.schedule, lay.chunks_per_rank)
    if lay.cp % lay.cp_a2a:
        return f"cp_a2a={lay.cp_a2a} does not divide cp={lay.cp}"
    if lay.recompute not in (False, True, "full", "selective"):
        return f"recompute={lay.recompute!r}: expected False, True, 'full' or 'selective'"
    return None


def check(spec: ModelSpec, lay: Layout, cluster: Cluster | None = None) -> None:
    """Raise ``ValueError`` naming the reason where the engine cannot run ``lay``
    (``shape_reason``, then ``prune_reason`` with tp allowed across nodes; without a
    cluster, the reasons that need none), as every public planner function that prices a
    layout does before pricing it. What the search prunes as the same as another layout
    is priced as that one: ZeRO with dp x cp = 1 as ZeRO-0, FP8 on a GPU without it as bf16
    (``Layout.fp8``)."""
    why = shape_reason(lay)
    if not why:
        same = replace(lay, fp8=False, zero=lay.zero if lay.dp * lay.cp > 1 else 0)
        why = prune_reason(spec, same, cluster, tp_across_nodes=True)
    if why:
        raise ValueError(f"{lay.label()}: {why}")


def layout_reason(spec: ModelSpec, lay: Layout) -> str | None:
    """The reasons of ``prune_reason`` beyond tp's and the chunk count."""
    why = micro_batches_refusal(lay.schedule, lay.pp, lay.micro_batches, lay.chunks_per_rank)
    if why:  # the config's own line, as below
        return why
    mode = ("selective" if lay.selective or lay.recompute == "selective" else
            "full" if lay.recompute == "full" else "stage" if lay.recompute else "none")
    refusal = split_backward_refusal(lay.schedule, lay.zero, mode)
    if refusal:  # the config's own line
        return refusal
    why = (sequence_refusal(spec.block_size, lay.cp, lay.tp, lay.sp)
           or expert_refusal(lay.ep, lay.dp, spec.n_experts if spec.moe else 0))
    if why:  # the config's own lines
        return why
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
