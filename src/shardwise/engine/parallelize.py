"""The parallelization steps, public, in the order the engine applies them.

In the spirit of torchtitan's ``parallelize_llama`` (``apply_tp``, ``apply_ac``,
``apply_compile``, ``apply_fsdp``): each step takes this rank's layers (``(name, module)``
pairs: ``layers_of(chunks)`` for pipeline chunks, or a user's own list), the group or
section it needs, and changes the modules in place or returns the new ones.
``Engine._parallelize`` calls them in this order:

1. ``apply_tp`` then ``apply_ep``: on the meta device, before materialisation
   (``engine.model.build_local_model`` runs them on each kept layer);
2. ``apply_cp``: this rank's ``ContextParallel`` (its ring of cp ranks);
3. ``apply_float8``: torchao's float8 Linear layers (``training.precision = "fp8"``);
4. ``apply_ac``: activation checkpointing per layer (``parallel.recompute = "selective"``,
   or ``"full"`` every ``recompute_every``-th block), then ``apply_activation_offload``
   (``parallel.activation_offload``);
5. ``apply_compile``: ``torch.compile`` each layer (``training.compile``);
6. ``apply_dp``: the gradient sync of ``parallel.zero`` (``engine.sync``).

Rules the config checks at the door (``base.config``) are asserted here, not refused again.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardwise.comm.replicas import NO_REPLICAS, Replicas
from shardwise.engine.sync import ReplicatedSync, SplitSync
from shardwise.models.description import ModelDescription
from shardwise.parallel.activation_checkpoint import CUDA_REFUSAL as SELECTIVE_ON_CUDA
from shardwise.parallel.activation_checkpoint import (
    checkpoint_selectively,
    checkpoint_whole,
    offload_saved,
)
from shardwise.parallel.context import ContextParallel, Ring
from shardwise.parallel.context.ulysses import Heads
from shardwise.parallel.experts import is_expert, parallelize_experts
from shardwise.parallel.tensor_parallel.group import RankGroup
from shardwise.parallel.tensor_parallel.plan import parallelize
from shardwise.parallel.tensor_parallel.random import ParallelRNG
from shardwise.parallel.zero.optimizer import ZeroDataParallel
from shardwise.parallel.zero.stage3 import ZeroStage3

Layers = list[tuple[str, nn.Module]]


def zero3_shared_reason(v: int, name: str, a: int, b: int) -> str:
    """The one-line refusal of ZeRO-3 when chunks ``a`` and ``b`` of one rank share the
    parameter ``name`` (``LocalModel.shared_across_chunks``): ZeRO-3 shards each chunk apart."""
    return (f"parallel.zero=3 with parallel.chunks_per_rank={v}: {name} is shared by chunks "
            f"{a} and {b} of one rank (a tied embedding at pp = 1), and ZeRO-3 shards each "
            "chunk apart; set model.tie_weights = false or use pp > 1")


def layers_of(chunks) -> Layers:
    """``(full model name, layer)`` of every layer of ``chunks`` (``{id: StageChunk}``, in
    chunk order)."""
    return [(n, layer) for c in sorted(chunks)
            for n, layer in zip(chunks[c].names, chunks[c].layers)]


def apply_tp(layers: Layers, description: ModelDescription, tp: RankGroup,
             rng: ParallelRNG | None = None) -> Layers:
    """Each layer sharded by the description's tensor-parallel plan (vocab-parallel
    embedding and head, column / row parallel linears, sequence-parallel norms; Shoeybi et
    al. 2019, section 3); meta layers stay on meta. Identity with tp = 1."""
    if tp.size == 1:
        return layers
    return [(name, parallelize(m, description.tp_plan, tp, rng, name=name,
                               vocab_size=description.vocab_size)) for name, m in layers]


def apply_ep(layers: Layers, description: ModelDescription, ep: RankGroup, tp: RankGroup,
             all_to_all: str = "native") -> Layers:
    """The plan's ``experts`` modules split by expert over ``ep`` and by width over ``tp``,
    tokens dispatched with ``all_to_all`` (``parallel.experts``; DeepSpeed-MoE, GShard).
    Identity with ep = tp = 1."""
    if tp.size == 1 and ep.size == 1:
        return layers
    return [(name, parallelize_experts(m, description.tp_plan, ep, tp, name=name,
                                       algorithm=all_to_all)) for name, m in layers]


def apply_cp(description: ModelDescription, topology, seq_len: int, device: torch.device,
             distributed: bool = True, a2a: int = 1,
             algorithm: str = "native") -> ContextParallel | None:
    """With cp > 1, this rank's ``ContextParallel``: each sequence cut into 2 cp chunks, this
    rank keeping i and 2cp-1-i, attention as ring attention (Liu et al. 2023) or, with
    ``a2a`` > 1 (``ParallelConfig.cp_heads``), an all-to-all over head groups of ``a2a``
    consecutive cp ranks (``algorithm``: ``parallel.all_to_all``) and ring attention across
    them (``parallel.context.ulysses``). None with cp = 1. ``ValueError`` (one line) for a
    model that does not read positions through ``models.sequence``
    (``ModelDescription.context_parallel``) or a ``seq_len`` 2 cp does not divide."""
    if topology.cp == 1:
        return None
    if not description.context_parallel:  # a hand-built model: the config cannot know
        raise ValueError(f"parallel.cp={topology.cp}: model {description.kind!r} does not "
                         "say it reads token positions from models.sequence.positions and "
                         "attends through models.gpt.causal_attention "
                         "(ModelDescription.context_parallel); use cp = 1")
    if a2a < topology.cp and not description.ring_attention:
        raise ValueError(f"parallel.cp={topology.cp}: model {description.kind!r} cannot run "
                         "under ring attention (ModelDescription.ring_attention); use "
                         "parallel.cp_comm = \"all_to_all\"")
    whole = Ring(topology.groups.cp if distributed else None,
                 tuple(topology.axis_ranks("cp")), topology.cp_rank)
    if a2a == 1:
        cp = ContextParallel(whole, device)
    else:
        heads, ring = _cp_subgroups(topology, a2a, whole, distributed, algorithm)
        cp = ContextParallel(ring, device, heads=heads, whole=whole)
    cp.check(seq_len)
    return cp


def _cp_subgroups(topology, a2a: int, whole: Ring, distributed: bool,
                  algorithm: str) -> tuple[Heads, Ring]:
    """This rank's head group (``a2a`` consecutive cp ranks) and ring (the cp ranks of its
    index in every head group) for cp = a2a x ring; the whole cp group is the head group
    when the ring has one rank. Makes the sub-groups of every cp group of the world, in one
    order on every rank (``torch.distributed.new_group`` is collective)."""
    import torch.distributed as dist

    cp, me = whole.size, whole.rank
    g, a = divmod(me, a2a)
    heads_ranks, ring_ranks = whole.ranks[g * a2a:(g + 1) * a2a], whole.ranks[a::a2a]
    if a2a == cp:
        return Heads(whole.group, heads_ranks, a, algorithm), Ring()
    heads_group = ring_group = None
    if distributed:
        for ranks in topology.all_axis_groups("cp"):
            for sub in [ranks[i:i + a2a] for i in range(0, cp, a2a)] + [
                    ranks[i::a2a] for i in range(a2a)]:
                group = dist.new_group(sub)
                if tuple(sub) == heads_ranks:
                    heads_group = group
                if tuple(sub) == ring_ranks:
                    ring_group = group
    return (Heads(heads_group, heads_ranks, a, algorithm),
            Ring(ring_group, ring_ranks, g))


def apply_float8(layers: Layers, description: ModelDescription, recipe: str,
                 device: torch.device, tp: RankGroup | None = None) -> list[str]:
    """Eligible ``nn.Linear`` swapped for torchao's ``Float8Linear`` (``parallel.float8``:
    same Parameters, bf16 around float8 matmuls, ``recipe`` its scaling), after tp
    sharding and before the dp sync and compile. Returns the converted module names.
    ``ValueError`` (one line) without torchao or on a device without float8 matmuls."""
    from shardwise.parallel.float8 import check_fp8, convert_layers

    assert tp is None or tp.size == 1, "config: training.precision=fp8 refuses parallel.tp > 1"
    check_fp8(device.type, [torch.cuda.current_device() if device.index is None
                            else device.index] if device.type == "cuda" else None)
    return convert_layers(layers, description.style_of, recipe,
                          high_precision=description.is_high_precision)


def apply_ac(layers: Layers, device: torch.device, rng: ParallelRNG | None = None,
             mode: str = "selective", blocks: dict[str, int] | None = None,
             every: int = 1) -> list[str]:
    """Activation checkpointing of this rank's layers, in place; returns the names of those
    checkpointed. ``mode`` "selective": every layer, matmul and attention outputs and the
    outputs of the collectives in its forward kept, the rest recomputed in backward
    (torchtitan's op-level selective AC; ``ValueError`` on CUDA, not verified there yet).
    "full": the transformer blocks (``blocks``: layer name -> its number among the model's
    blocks, from 1) whose number ``every`` divides, each keeping only its input and its
    collectives' outputs (torchtitan's full AC, ``selective_ac_option = every``). ``rng``:
    the tp dropout stream, replayed alike (``parallel.activation_checkpoint``)."""
    if mode == "selective":
        if device.type == "cuda":
            raise ValueError(SELECTIVE_ON_CUDA)
        for name, layer in layers:
            checkpoint_selectively(layer, rng=rng, name=name)
        return [name for name, _ in layers]
    assert mode == "full" and blocks is not None, mode
    chosen = [(n, m) for n, m in layers if n in blocks and blocks[n] % every == 0]
    for name, layer in chosen:
        checkpoint_whole(layer, rng=rng, name=name)
    return [name for name, _ in chosen]


def apply_activation_offload(layers: Layers, device: torch.device,
                             blocks: dict[str, int]) -> list[str]:
    """Each transformer block's saved tensors in host memory between its forward and its
    backward (``parallel.activation_offload``; ``offload_saved``), in place; ``blocks`` as
    ``apply_ac``'s. Returns the names of the blocks wrapped."""
    chosen = [(n, m) for n, m in layers if n in blocks]
    for _, layer in chosen:
        offload_saved(layer, device)
    return [name for name, _ in chosen]


def block_numbers(local) -> dict[str, int]:
    """Layer name -> its number among the model's transformer blocks (1 ... L) for this
    rank's layers (``local``: an ``engine.model.LocalModel``): the layers of the pipeline
    description but its first (the embedding) and its last (the head), numbered by their
    place in the whole model, so the same blocks are chosen in every layout."""
    part = local.partition
    last = part.bounds[-1] - 1
    return {name: i for c in sorted(local.chunks)
            for name, i in zip(local.chunks[c].names, part.layers(c)) if 0 < i < last}


def apply_compile(layers: Layers) -> None:
    """``torch.compile`` every layer in place (``nn.Module.compile``): one graph per kind of
    layer, so a pipeline chunk of any length reuses it. The collectives of tp and cp and
    ZeRO-3's gather / free hooks are ``torch.compiler.disable``d: they run eagerly between
    the compiled pieces."""
    for _, layer in layers:
        layer.compile()


def apply_dp(local, chunks: dict[int, nn.Module], topology, parallel, *,
             dtype: torch.dtype, loss_scaler=None, distributed: bool = True,
             replicas: Replicas | None = None, offload: bool = False,
             offload_params: bool = False):
    """The gradient sync of ``parallel.zero`` (a ``ParallelConfig``) for this rank's chunks
    (``local``: an ``engine.model.LocalModel``; ``engine.sync``) over the dp x cp replicas of
    every parameter; under ep > 1 the expert parameters over their own replicas, the
    ep_dp x cp group, their sums divided by dp x cp as the dense ones (each expert's
    gradient already holds what its ep group routed to it).
    Under ZeRO-3 each entry of ``chunks`` is replaced by its ``ZeroStage3`` wrapper.
    ``replicas``: the replicas outside this job (``comm.torchft_replicas``, fault tolerance;
    ``dense_sync_group``). ``ValueError`` (one line) for ZeRO-3 with a parameter shared by
    two chunks of this rank (a property of a hand-built model the config cannot see), and
    for replicas outside the job with HSDP inside it or with expert parameters.
    ``offload``: every sync keeps its fp32 masters in host memory (``training.offload =
    "optimizer"``; ZeRO-Offload, Ren et al. 2021); ``offload_params`` (``"optimizer+params"``,
    ZeRO-3 only, as the config requires): ZeRO-3's parameter shards too."""
    named = local.named_parameters()
    groups = topology.groups if distributed else None
    experts = [(n, q) for n, q in named if is_expert(q)]
    kw = dict(local=local, chunks=chunks, parallel=parallel, dtype=dtype,
              loss_scaler=loss_scaler, distributed=distributed, offload=offload,
              offload_params=offload_params)
    if experts and replicas is not None and replicas is not NO_REPLICAS:
        raise ValueError("fault_tolerance.enable with expert parameters: their sync spans "
                         "the ep_dp x cp ranks of one job, not the replica groups; train "
                         "without experts (model.n_experts = 0) or without fault tolerance")
    *dense_args, replicas = dense_sync_group(topology, parallel, distributed, replicas)
    if not experts or not distributed:
        return _sync_of(named, *dense_args, replicas=replicas, **kw)
    if parallel.zero == 3:  # one wrapper, each unit's experts gathered over their replicas
        return _sync_of(named, *dense_args, replicas=replicas, expert_group=groups.ep_dp_cp,
                        **kw)
    dense = [(n, q) for n, q in named if not is_expert(q)]
    return SplitSync(_sync_of(dense, *dense_args, replicas=replicas, **kw),
                     _sync_of(experts, groups.ep_dp_cp, topology.ep_dp_cp,
                              topology.ep_dp_cp_rank, divisor=topology.dp_cp, **kw))


def dense_sync_group(topology, parallel, distributed: bool = True,
                     replicas: Replicas | None = None) -> tuple:
    """``(group, size, rank, replicas)`` of the dense parameters' sync: ZeRO 1-3 under HSDP
    (``parallel.dp_replicate`` > 1) shard over one replica (``dp_shard_cp``) and average
    across the replicas (``comm.replicas.Replicas``); otherwise the whole dp x cp group and no
    replicas (ZeRO-0 too: one all-reduce over every replica is already HSDP's mean, in one
    collective). ``replicas`` given (the replica groups of a fault-tolerant job, each its own
    job: ``comm.torchft_replicas``): the whole dp x cp group of this job, then the mean over
    those, for every ZeRO stage; ``ValueError`` (one line) with HSDP inside the job too."""
    t = topology
    if replicas is not None and replicas is not NO_REPLICAS:
        if t.dp_replicate > 1:
            raise ValueError(f"fault_tolerance.enable with parallel.dp_replicate="
                             f"{t.dp_replicate}: each replica group is its own job; shard "
                             "over its whole dp (parallel.dp_replicate = 1)")
        group = t.groups.dp_cp if distributed else None
        return group, t.dp_cp, t.dp_cp_rank, replicas
    if parallel.zero == 0 or t.dp_replicate == 1 or not distributed:
        group = t.groups.dp_cp if distributed else None
        return group, t.dp_cp, t.dp_cp_rank, NO_REPLICAS
    replicas = Replicas(t.groups.dp_replicate, t.dp_replicate, t.dp_replicate_rank)
    return t.groups.dp_shard_cp, t.dp_shard_cp, t.dp_shard_cp_rank, replicas


def _sync_of(named, group, size: int, rank: int, *, local, chunks, parallel,
             dtype, loss_scaler, distributed: bool, replicas: Replicas = NO_REPLICAS,
             divisor: int | None = None, expert_group=None, offload: bool = False,
             offload_params: bool = False):
    """One gradient sync of ``parallel.zero`` for ``named`` over ``group`` (ZeRO-3 with
    ``expert_group``: the expert parameters of each unit sharded over that group)."""
    p = parallel
    names = {id(q): n for n, q in named}
    params = [q for _, q in named]
    tied = frozenset(id(q) for n, q in named if n in local.tied)  # across stages
    if p.zero == 0 or not distributed:
        return ReplicatedSync(params, names, group, size, rank, dtype, p.bucket_mb,
                              p.first_bucket_mb, p.allreduce, divisor=divisor,
                              replicas=replicas, offload=offload)
    if p.zero in (1, 2):
        container = nn.ModuleList(local.chunks[c] for c in sorted(local.chunks))
        # broadcast from the group's first rank: ``named`` alone, the trainable parameters
        # this sync holds, over the group they are replicated on (dense: dp x cp; experts:
        # ep_dp x cp). Frozen parameters (LoRA's base) and buffers are built alike on every
        # rank that holds them, as ZeRO-0 (no broadcast) relies on; a whole-module broadcast
        # over dp x cp would overwrite each ep rank's frozen experts with the first one's.
        return ZeroDataParallel(container, group, p.zero, p.bucket_mb, dtype, loss_scaler,
                                names=names, isolate=tied, explicit=True, params=params,
                                divisor=divisor, replicas=replicas, offload=offload)
    # ZeRO-3: each chunk its own module (its layers the units, its own flat buffers), so
    # the interleaved schedule gathers and reduce-scatters a chunk around its own
    # micro-batches, independently of the rank's other chunks; joined as one sync
    shared = local.shared_across_chunks()
    if shared is not None:
        raise ValueError(zero3_shared_reason(p.chunks_per_rank, *shared))
    wrappers = []
    for c in sorted(local.chunks):
        chunk = local.chunks[c]
        chunks[c] = ZeroStage3(chunk, group, list(zip(chunk.names, chunk.layers)), dtype,
                               loss_scaler, names, isolate=tied, expert_group=expert_group,
                               replicas=replicas, offload=offload,
                               offload_params=offload_params)
        wrappers.append(chunks[c])
    return SplitSync(*wrappers)

