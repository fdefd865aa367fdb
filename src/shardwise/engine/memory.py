"""Bytes each rank holds between steps, predicted for any layout without running it.

The prediction builds the rank's part of the model on PyTorch's meta device (shapes, no
storage) exactly as the engine does (``engine.model.build_local_model``: pipeline chunks,
tp shards, vocabulary padding, tied copies) and packs its parameters into the same buckets
or units as the dp sync would (``build_buckets``, padded to dp), then applies the byte
counts of mixed-precision Adam (Micikevicius et al. 2018; Rajbhandari et al. 2020, section
3), with b bytes per compute-dtype value and P this rank's parameter elements:

    ZeRO-0   params b P        grads b P        optimizer 8 P + (4 P unless fp32: masters)
    ZeRO-1   params b P_pad    grads b P_pad    optimizer 4 S + 8 R
    ZeRO-2   params b P_pad    grads b S        optimizer 4 S + 8 R
    ZeRO-3   params b S (0 in fp32: the master is what forward gathers)
                               grads b S        optimizer 4 S + 8 R

P_pad is P with every bucket (unit, for ZeRO-3) padded to a multiple of dp, S = P_pad / dp
the shard this rank owns, R <= S its real elements (AdamW keeps no moments for padding: the
padding is stated, ``padding``). Under expert parallelism (ep > 1) the rank holds E / ep of
each layer's experts, and with ZeRO-1/2 their buckets are padded to, and sharded over, the
dp / ep ranks that hold the same experts (``engine.sync``); the dense ones over dp. Under
context parallelism the cp ranks are replicas of the weights and ZeRO shards over dp x cp
of them (``topology.dp_cp``): read dp x cp for dp above, and (dp / ep) x cp for the
experts' dp / ep (``topology.ep_dp_cp``); cp changes no other static byte (it splits
activations: ``planner.memory``). Under HSDP (``dp_replicate`` = R > 1) ZeRO 1-3 shard the
dense parameters over one replica's dp / R ranks (x cp), so read dp / R for dp above; the
experts' group spans the replicas as before. ``Engine.memory_bytes`` measures the same
categories from the tensors a rank holds; ``tests/test_layouts.py`` requires them equal.
"""

from __future__ import annotations

import torch

from shardwise.engine.model import build_local_model
from shardwise.engine.parallelize import zero3_shared_reason
from shardwise.parallel.data_parallel.buckets import MiB, build_buckets
from shardwise.parallel.experts import is_expert
from shardwise.parallel.precision import DTYPES
from shardwise.parallel.pipeline.schedules import placement_of
from shardwise.parallel.tensor_parallel.group import RankGroup


def _shard(padded: list[int], sizes: list[int], dp: int, dp_rank: int) -> tuple[int, int]:
    """(elements owned, real elements owned) of buckets ``padded`` holding ``sizes`` real."""
    owned = real = 0
    for n_pad, n in zip(padded, sizes):
        s = n_pad // dp
        owned += s
        real += max(0, min(n, (dp_rank + 1) * s) - dp_rank * s)
    return owned, real


def rank_model(model, *, pp: int = 1, pp_rank: int = 0, tp: int = 1, tp_rank: int = 0,
               chunks_per_rank: int = 1, sequence_parallel: bool = False,
               partition_by: str = "layers", ep: int = 1, ep_rank: int = 0,
               schedule: str = "1f1b", lora=None):
    """The ``LocalModel`` the engine builds at (pp_rank, tp_rank, ep_rank) of ``model`` (a
    ``ModelDescription`` or a registered config), on the meta device: shapes only, no
    storage. What ``predict_rank`` counts; it depends on no dp, cp or ZeRO choice, so a
    caller pricing many of those for one rank may build it once and pass it
    (``predict_rank(local=)``). Raises ``ValueError`` as ``build_local_model`` does."""
    mine = [c for c, r in enumerate(placement_of(schedule, pp, chunks_per_rank)) if r == pp_rank]
    with torch.device("meta"):
        return build_local_model(
            model, pp=pp, pp_rank=pp_rank, chunk_ids=mine,
            n_chunks=pp * chunks_per_rank,
            tp=RankGroup(size=tp, rank=tp_rank, sequence_parallel=sequence_parallel),
            seed=0, dropout_seed=0, device=torch.device("meta"), partition_by=partition_by,
            ep=RankGroup(size=ep, rank=ep_rank, axis="ep"), lora=lora)


def predict_rank(model, *, dp: int = 1, pp: int = 1, tp: int = 1, dp_rank: int = 0,
                 pp_rank: int = 0, tp_rank: int = 0, chunks_per_rank: int = 1, zero: int = 0,
                 precision: str = "fp32", bucket_mb: float = 25.0,
                 sequence_parallel: bool = False, partition_by: str = "layers",
                 ep: int = 1, cp: int = 1, cp_rank: int = 0, dp_replicate: int = 1,
                 schedule: str = "1f1b", state_bytes: int = 8,
                 offload: bool = False, offload_params: bool = False, lora=None,
                 local=None) -> dict:
    """Predicted bytes of the rank at (dp_rank, pp_rank, cp_rank, tp_rank) of ``model`` (a
    ``ModelDescription`` or a registered config: GPT, Llama, yours): ``{"params", "grads",
    "optimizer", "total", "padding"}`` (padding: elements of padding this rank owns).
    ``ep``: expert-parallel ranks (folded over dp: the rank's ep rank is dp_rank mod ep).
    ``dp_replicate``: HSDP's replicas (ZeRO shards over dp / dp_replicate of the dp ranks).
    ``schedule``: the pipeline schedule, for its chunk placement (zbv's V).
    ``state_bytes``: AdamW's two moments' bytes per element (8 in fp32, 4 with
    ``optimizer.state_dtype = "bf16"``). ``offload`` (``training.offload = "optimizer"``):
    the masters are copies of their own in host memory even in fp32 (``host``: the
    optimizer's bytes, all on the host; 0 without offload). ``offload_params``
    (``"optimizer+params"``, ZeRO-3 only): its compute-dtype shards in host memory too
    (``host`` adds ``params``; in fp32 the master is the shard, so ``params`` is 0 again);
    the device keeps ``total - host``: the gradient shards. ``lora`` (a ``LoRAConfig``
    with rank > 0): P above is the adapters' elements only, and the frozen base adds its
    b bytes per element to ``params`` (no gradient, no optimizer state, no ZeRO shard).
    ``local``: this rank's model as ``rank_model`` builds it for the same arguments (None:
    built here); its parameters take ``precision``'s dtype in place, on meta.
    Raises ``ValueError`` as the engine would for a layout it cannot build, and for
    ``offload_params`` without ZeRO-3."""
    if offload_params and zero != 3:
        raise ValueError(f"offload_params with zero={zero}: only ZeRO-3 keeps parameter "
                         "shards between uses")
    ep_rank = dp_rank % ep  # ep folds over dp (before dp x cp is read as ZeRO's group)
    # ZeRO's groups are the replicas: of the dense weights dp x cp (this rank at
    # dp_rank * cp + cp_rank), of its experts (dp / ep) x cp (at ep_dp_rank * cp + cp_rank)
    ep_dp, ep_dp_rank = dp // ep * cp, dp_rank // ep * cp + cp_rank
    shard = dp // dp_replicate if zero else dp  # HSDP: ZeRO 1-3 within one replica
    dp, dp_rank = shard * cp, dp_rank % shard * cp + cp_rank
    b = torch.empty(0, dtype=DTYPES[precision]).element_size()
    if local is None:
        local = rank_model(model, pp=pp, pp_rank=pp_rank, tp=tp, tp_rank=tp_rank,
                           chunks_per_rank=chunks_per_rank,
                           sequence_parallel=sequence_parallel, partition_by=partition_by,
                           ep=ep, ep_rank=ep_rank, schedule=schedule, lora=lora)
    with torch.device("meta"):
        named = local.named_parameters()  # the trainable ones (LoRA: the adapters)
        frozen = b * sum(q.numel() for _, q in local.frozen_parameters())
        for _, q in named:
            q.data = q.data.to(DTYPES[precision])
        params = [q for _, q in named]
        P = sum(q.numel() for q in params)
        if zero == 0:
            out = {"params": b * P, "grads": b * P,
                   "optimizer": state_bytes * P + (0 if b == 4 and not offload else 4 * P),
                   "padding": 0}
        elif zero in (1, 2):
            tied = frozenset(id(q) for n, q in named if n in local.tied)
            groups = [([q for q in params if not is_expert(q)], dp, dp_rank),
                      ([q for q in params if is_expert(q)], ep_dp, ep_dp_rank)]
            padded, S, R = [], 0, 0
            for mine, size, rank in groups if ep > 1 else [(params, dp, dp_rank)]:
                buckets = build_buckets(mine, max(1, int(bucket_mb * MiB)), pad_to=size,
                                        isolate=tied)
                pad = [bk.buffer.numel() for bk in buckets]
                owned, real = _shard(pad, [bk.numel for bk in buckets], size, rank)
                padded, S, R = padded + pad, S + owned, R + real
            out = {"params": b * sum(padded), "grads": b * (sum(padded) if zero == 1 else S),
                   "optimizer": 4 * S + state_bytes * R, "padding": S - R}
        else:
            S = R = 0
            for sizes, size, rank in ((_units(local, False), dp, dp_rank),
                                      (_units(local, True), ep_dp, ep_dp_rank)):
                owned, real = _shard([-(-n // size) * size for n in sizes], sizes, size, rank)
                S, R = S + owned, R + real
            lp = b == 4 and (offload_params or not offload)  # the master is what is gathered
            out = {"params": 0 if lp else b * S, "grads": b * S,
                   "optimizer": 4 * S + state_bytes * R, "padding": S - R}
    out["params"] += frozen
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    out["host"] = ((out["optimizer"] if offload or offload_params else 0)
                   + (out["params"] if offload_params else 0))
    return out


def _units(local, experts: bool | None = None) -> list[int]:
    """Elements of each ZeRO-3 unit, in the engine's order: chunk by chunk (each chunk a
    ``ZeroStage3`` of its own: with the interleaved schedule, v per rank), every layer of
    the chunk (a weight tied across stages first, as a unit of its own), then the chunk's
    root unit of parameters shared by two of its layers (a weight tied within the chunk).
    ``experts``: only the units of expert parameters (True: under ep > 1 each layer's
    experts are a unit of their own, sharded over their replicas) or of the others (False);
    None: every parameter. Raises ``ValueError`` as the engine does for a parameter two
    chunks share."""
    shared = local.shared_across_chunks()
    if shared is not None:
        raise ValueError(zero3_shared_reason(len(local.chunks), *shared))
    keep = ((lambda q: q.requires_grad) if experts is None  # LoRA's frozen base: no unit
            else (lambda q: q.requires_grad and is_expert(q) == experts))
    tied = {id(q) for n, q in local.named_parameters() if n in local.tied}
    sizes = []
    for c in sorted(local.chunks):
        chunk = local.chunks[c]
        owners: dict[int, int] = {}
        for layer in chunk.layers:
            for q in layer.parameters():
                if keep(q):
                    owners[id(q)] = owners.get(id(q), 0) + 1
        root = 0
        for layer in chunk.layers:
            own = [q for q in layer.parameters() if owners.get(id(q)) == 1]
            sizes += [q.numel() for q in own if id(q) in tied]
            n = sum(q.numel() for q in own if id(q) not in tied)
            if n:
                sizes.append(n)
        seen = set()
        for layer in chunk.layers:
            for q in layer.parameters():
                if owners.get(id(q), 0) > 1 and id(q) not in seen:
                    seen.add(id(q))
                    root += q.numel()
        sizes += [root] if root else []
    return sizes
