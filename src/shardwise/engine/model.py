"""Split, then parallelize: this rank's part of any described model for any layout.

The composition of torchtitan (split the model for the pipeline, then parallelize each
part) and Megatron-LM (tensor-parallel layers inside each pipeline chunk), driven by the
model's ``models.description.ModelDescription`` (no model is imported here):

1. build the model on the meta device (no memory), logging its initialising writes
   (``models.meta_init.record_init``);
2. cut its layers (``description.layers``: embedding, blocks, head) into ``pp * v`` chunks
   and keep this rank's (chunk ``c`` lives on pipeline rank ``c % pp``); the other layers
   are dropped;
3. with tp > 1, shard each kept layer by the model's tensor-parallel plan, still on meta
   (``parallel.tensor_parallel.plan.parallelize``: vocab-parallel embedding and head,
   column / row parallel linears, Shoeybi et al. 2019, section 3; under SP a mixture of
   experts is one sequence-parallel region, its "moe" style); with ep > 1 or tp > 1,
   split the plan's ``experts`` modules by expert over ep and by width over tp
   (``parallel.experts.parallelize_experts``);
4. materialise the kept parameters on ``device`` and give them their values by replaying
   the single-process constructor's random stream (``_initialise``): each equals, bit for
   bit, its slice of ``torch.manual_seed(seed); description.build()``, and no rank ever
   holds more than its own parameters plus one full tensor. Or, from a Hugging Face
   checkpoint (``init_from``), read each parameter's slice from its safetensors file
   (``_load_hf``): a rank reads the bytes of its own slices only. Wrapping for dp
   (buckets, ZeRO) is ``engine.sync``'s job.

Tied input/output embeddings (``description.tied``): with pp = 1 the head shares the embedding's parameter. With
pp > 1 the head on the last stage gets its own copy, equal at start; the engine sums the two
copies' gradients between the first and the last stage before every step (Megatron's
embedding group), so the copies stay equal and the gradient is the one of the tied weight.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardwise.data.sampler import IGNORE_INDEX
from shardwise.engine.parallelize import apply_ep, apply_tp
from shardwise.models.description import ModelDescription, describe
from shardwise.models.meta_init import InitRecord, materialise, record_init, replay_init
from shardwise.parallel.lora import apply_lora, full_shape, init_values, is_lora
from shardwise.parallel.pipeline.partition import (
    Partition,
    balanced,
    partition_layers,
    profile_layers,
)
from shardwise.parallel.pipeline.stage import StageChunk
from shardwise.parallel.tensor_parallel.group import RankGroup
from shardwise.parallel.tensor_parallel.layers import gather_tensor, shard_tensor
from shardwise.parallel.tensor_parallel.loss import vocab_parallel_cross_entropy
from shardwise.parallel.tensor_parallel.plan import check_divisible
from shardwise.parallel.tensor_parallel.random import ParallelRNG
from shardwise.parallel.tensor_parallel.state import gather_like, shard_like


@dataclass
class LocalModel:
    """This rank's chunks and what the engine needs to know about them.

    ``description``: the model's. ``chunks``: global chunk id -> ``StageChunk`` (its
    parameters keep the full model's names, see ``named_parameters``). ``tied``: names of
    this rank's copies of the tied weight that cross pipeline stages (the embedding's on
    the first stage, the head's on the last), empty when the head shares the embedding's
    parameter or nothing is tied. ``rng``: the tensor-parallel dropout stream (None with
    tp = 1). ``vocab_params``: names of the parameters split by vocabulary rows.
    ``moe_layers``: every mixture-of-experts layer's full name; ``moe_local``: (index in
    ``moe_layers``, module) of this rank's. ``loss_fn(logits, targets, denominator=None)``:
    the cross-entropy summed over target tokens over ``denominator`` (default: the mean;
    vocabulary-parallel with tp > 1).
    """

    description: ModelDescription
    chunks: dict[int, StageChunk]
    partition: Partition
    tp: RankGroup
    rng: ParallelRNG | None
    vocab_params: tuple[str, ...] = ()
    flops_per_token: float = 0.0
    ep: RankGroup = field(default_factory=lambda: RankGroup(axis="ep"))
    moe_layers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        tp, d = self.tp, self.description
        self.loss_fn: Callable = (_vocab_parallel_loss(tp, d.vocab_size) if tp.size > 1
                                  else lm_loss_fp32)
        self.moe_local = [
            (self.moe_layers.index(f"{lname}.{sub}" if sub else lname), m)
            for c in sorted(self.chunks)
            for lname, layer in zip(self.chunks[c].names, self.chunks[c].layers)
            for sub, m in layer.named_modules() if callable(getattr(m, "pop_router_stats", None))]

    @property
    def n_chunks(self) -> int:
        """Chunks of the whole model (``pp * v``)."""
        return self.partition.parts

    @property
    def tied(self) -> tuple[str, ...]:
        """Names of this rank's copies of the tied weight across stages (see above)."""
        d = self.description
        if d.tied is None or (self.has_first and self.has_last):  # one parameter, shared
            return ()
        return (d.tied[:1] if self.has_first else ()) + (d.tied[1:] if self.has_last else ())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(full model name, parameter)`` of this rank's trainable parameters, chunk by
        chunk, each parameter once (a tied head listed under the embedding's name, as the
        model does); with LoRA the adapters only (``frozen_parameters``: the rest)."""
        seen, out = set(), []
        for c in sorted(self.chunks):
            for name, p in self.chunks[c].model_parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def frozen_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(full model name, parameter)`` of this rank's frozen parameters (LoRA's base),
        each once."""
        seen, out = set(), []
        for c in sorted(self.chunks):
            for name, p in self.chunks[c].model_parameters():
                if id(p) not in seen and not p.requires_grad:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def shared_across_chunks(self) -> tuple[str, int, int] | None:
        """``(name, chunk, other chunk)`` of the first parameter two of this rank's chunks
        share (the tied embedding and head at pp = 1 with more than one chunk), else None."""
        owner: dict[int, int] = {}
        for c in sorted(self.chunks):
            for name, p in self.chunks[c].model_parameters():
                if owner.setdefault(id(p), c) != c:
                    return name, owner[id(p)], c
        return None

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """``(full model name, buffer)`` of this rank's buffers, chunk by chunk: the training
        state its modules name in ``state_buffers`` (a mixture of experts' ``expert_bias``),
        replicated on every rank that holds the layer (the engine refuses other buffers)."""
        return [(f"{name}.{bname}", b) for c in sorted(self.chunks)
                for name, layer in zip(self.chunks[c].names, self.chunks[c].layers)
                for bname, b in layer.named_buffers()]

    @property
    def has_first(self) -> bool:
        """Whether this rank holds chunk 0: the embedding (the first stage)."""
        return 0 in self.chunks

    @property
    def has_last(self) -> bool:
        """Whether this rank holds chunk ``n_chunks - 1``: the head (the last stage)."""
        return self.n_chunks - 1 in self.chunks

    def full_tensor(self, name: str, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """The unsharded, unpadded tensor of ``local`` (parameter ``p`` named ``name``, or a
        tensor shaped like it: a moment, a master). Collective over tp when ``p`` is sharded,
        and over ep for an expert parameter."""
        full = gather_like(p, local, self.tp, self._rows(name))
        dim = getattr(p, "ep_dim", None)
        return full if dim is None or self.ep.size == 1 else gather_tensor(full, dim, self.ep)

    def local_tensor(self, name: str, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """Inverse of ``full_tensor``: this rank's slice (vocabulary padding added back)."""
        dim = getattr(p, "ep_dim", None)
        if dim is not None and self.ep.size > 1:
            full = shard_tensor(full, dim, self.ep)
        return shard_like(p, full, self.tp, self._rows(name))

    def _rows(self, name: str) -> int | None:
        return self.description.vocab_size if name in self.vocab_params else None


def _check_moe_layers(d: ModelDescription, model: nn.Module, names: tuple[str, ...]) -> None:
    """Each mixture-of-experts layer that states its ``n_experts`` or ``capacity_factor``
    (``models.moe.MoE`` does) must agree with the description, which the engine reads to
    shard experts over ep and to report dropped assignments: one-line ``ValueError`` naming
    the layer otherwise. A layer that states neither is taken at the description's word."""
    modules = dict(model.named_modules())
    for name in names:
        for attr in ("n_experts", "capacity_factor"):
            mine = getattr(modules[name], attr, None)
            if isinstance(mine, (int, float)) and mine != getattr(d, attr):
                raise ValueError(f"{d.kind}: {name}.{attr} is {mine} but the description's "
                                 f"{attr} is {getattr(d, attr)}; describe the model as its "
                                 "layers are built")


def build_local_model(model: Any, *, pp: int, pp_rank: int, chunk_ids: list[int],
                      n_chunks: int, tp: RankGroup, seed: int, dropout_seed: int,
                      device: torch.device, partition_by: str = "layers",
                      partition: Partition | None = None, time_sample: tuple = (1, 1),
                      average: Callable = lambda t: t, ep: RankGroup | None = None,
                      all_to_all: str = "native", init_from: str | None = None,
                      lora=None) -> LocalModel:
    """This rank's chunks of ``model`` (a ``ModelDescription`` or a registered config:
    ``GPTConfig``, ``LlamaConfig``) built after ``torch.manual_seed(seed)``, each parameter
    equal (``torch.equal``) to its slice of that model, built without ever materialising
    the whole model (the model on meta, then ``_initialise``); with ``device`` meta the
    parameters stay on meta (shapes only).

    ``chunk_ids``: the chunks this pipeline rank runs (``schedule.chunks_of(pp_rank)``);
    ``partition`` (or ``partition_by``: "layers" | "params") cuts the layers into
    ``n_chunks`` chunks ("time": layers profiled on a ``time_sample``-shaped batch, the
    seconds passed through ``average``, which must make every rank cut alike).
    ``dropout_seed`` seeds the tensor-parallel dropout stream (plus the tp rank, as
    Megatron's model-parallel RNG). ``ep``: the expert-parallel group (None: one rank),
    ``all_to_all`` its algorithm. ``init_from``: a Hugging Face checkpoint directory whose
    tensors the parameters take instead (``_load_hf``; the description's ``hf`` arch names
    them); ``seed`` is then not used. Raises ``ValueError`` (one line) when tp does not
    divide a size, ep the experts, the plan does not fit the model (under sequence
    parallelism: a mixture of experts not styled "moe"), or there are more chunks than layers, and ``CheckpointError`` (a ``ValueError``) for a checkpoint that lacks a
    tensor or holds it in another shape. ``lora`` (a ``LoRAConfig`` with rank > 0): low-rank
    adapters on its targeted linears (``parallel.lora.apply_lora``, before tp sharding), the
    base frozen; the adapters' values come from ``seed`` in every case (``init_values``).
    """
    d = describe(model)
    ep = ep if ep is not None else RankGroup(axis="ep")
    if tp.size > 1:
        check_divisible(d, tp)
    if ep.size > 1:
        if not d.n_experts:
            raise ValueError(f"ep={ep.size} but {d.kind} has no experts (model.n_experts = 0)")
        ep.shard(d.n_experts, "model.n_experts")
    record = record_init(d.build)  # every tensor on meta: nothing allocated
    d.check_plan(record.model)
    moe_layers = tuple(n for n, m in record.model.named_modules()
                       if callable(getattr(m, "pop_router_stats", None)))
    if moe_layers and not d.n_experts:
        raise ValueError(f"{d.kind}: {moe_layers[0]} is a mixture of experts "
                         "(pop_router_stats) but the description's n_experts is 0")
    _check_moe_layers(d, record.model, moe_layers)
    if tp.sequence_parallel and tp.size > 1:  # the router must read whole sequences
        for n in moe_layers:
            if d.style_of(n) != "moe":
                raise ValueError(f"{d.kind}: sequence parallelism needs the tp plan to give "
                                 f"the mixture of experts {n} the style 'moe'")
    if lora is not None and lora.rank:
        apply_lora(record.model, lora.targets, lora.rank, lora.alpha, lora.dropout,
                   styles=d.style_of)
    # the full shapes, before tp sharding replaces the layers' modules (init_from reads them)
    full_shapes = {n: tuple(p.shape) for n, p in record.model.named_parameters()}
    vocab_params = d.vocab_params(record.model)
    flops = d.flops_per_token(record.model)
    layers = d.layers(record.model)
    if n_chunks > len(layers):
        raise ValueError(f"cannot cut {len(layers)} layers (embedding, {len(layers) - 2} "
                         f"blocks, head) into {n_chunks} pipeline chunks")
    if partition is None and partition_by == "time":  # profiled here, averaged over ranks
        where = device if device.type == "cuda" else torch.device("cpu")  # where it trains
        sample = torch.zeros(time_sample, dtype=torch.long, device=where)
        secs = torch.tensor(profile_layers(_one_at_a_time(layers, where), sample).seconds,
                            dtype=torch.float64, device=device)
        partition = balanced(average(secs).cpu().tolist(), n_chunks)
    elif partition is None:
        partition = partition_layers([m for _, m in layers], n_chunks, by=partition_by)
    rng = ParallelRNG(dropout_seed, tp.rank, device) if tp.size > 1 else None
    head_here = n_chunks - 1 in chunk_ids
    emb_here = 0 in chunk_ids
    share = d.tied is not None and head_here and emb_here  # one stage holds both: one parameter
    chunks: dict[int, StageChunk] = {}
    for c in chunk_ids:
        named = [layers[i] for i in partition.layers(c)]  # on meta: shard, then materialise
        chunks[c] = StageChunk(apply_ep(apply_tp(named, d, tp, rng), d, ep, tp, all_to_all))
    del layers
    if d.tied is not None:
        _tie(chunks, d.tied, share)
    if lora is not None and lora.rank:  # the base frozen (the tied head copy too)
        for c in chunks.values():
            for name, p in c.model_parameters():
                p.requires_grad_(is_lora(name))
    local = LocalModel(description=d, chunks=chunks, partition=partition, tp=tp, rng=rng,
                       vocab_params=vocab_params, flops_per_token=flops, ep=ep,
                       moe_layers=moe_layers)
    assert local.n_chunks == n_chunks
    if torch.device(device).type != "meta":  # meta: shapes only (engine.memory's prediction)
        _initialise(local, record, seed, torch.device(device), init_from, full_shapes)
    return local


@torch.no_grad()
def _init_adapters(local: LocalModel, seed: int) -> None:
    """Each adapter parameter := its slice of ``parallel.lora.init_values`` (the layout's
    slice of a value that depends on the seed and the name only)."""
    for name, p in local.named_parameters():
        if is_lora(name):
            full = init_values(name, full_shape(name, p, local.tp.size), seed)
            _copy_slice(p.detach(), full.to(p.device, p.dtype), getattr(p, "tp_dim", None),
                        local.tp.rank)


def _tie(chunks: dict[int, StageChunk], tied: tuple[str, str], share: bool) -> None:
    """With both ends on this rank (``share``), point the head at the embedding's parameter
    (after tp sharding: the same vocabulary rows on the same rank, so tying survives it).
    Otherwise give the head its own parameter, a copy equal at start (the engine sums the
    copies' gradients across stages)."""
    head = _find(chunks, tied[1])
    if head is None:
        return
    layer, path = head
    owner_path, _, attr = path.rpartition(".")
    owner = layer.get_submodule(owner_path) if owner_path else layer
    if share:
        emb_layer, emb_path = _find(chunks, tied[0])
        setattr(owner, attr, emb_layer.get_parameter(emb_path))
    else:
        p = getattr(owner, attr)
        new = nn.Parameter(p.detach().clone())
        new.__dict__.update(p.__dict__)  # tp_dim
        setattr(owner, attr, new)


def _find(chunks: dict[int, StageChunk], name: str) -> tuple[nn.Module, str] | None:
    """(layer, name inside it) of parameter ``name`` among ``chunks``' layers, or None."""
    for c in chunks.values():
        for lname, layer in zip(c.names, c.layers):
            if name.startswith(lname + "."):
                return layer, name[len(lname) + 1:]
    return None


def _initialise(local: LocalModel, record: InitRecord, seed: int, device: torch.device,
                init_from: str | None = None,
                full_shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Materialise ``local``'s meta parameters on ``device`` with exactly the values of
    their slices of ``torch.manual_seed(seed); description.build()`` (CPU), never holding
    the model.

    How it stays exact: the model's values are what one CPU generator, seeded by
    ``torch.manual_seed(seed)``, produced in the constructor's order of writes. For the
    GPT: each ``nn.Linear`` / ``nn.Embedding`` / ``nn.LayerNorm`` first runs its own
    ``reset_parameters`` (Kaiming-uniform weights and uniform biases, normal(0, 1)
    embeddings, ones and zeros for norms), then ``GPT._init_weights`` redraws every Linear
    and Embedding weight as normal(0, 0.02) (the tied head redrawing the embedding's weight
    last) and zeroes the biases, then the residual projections are drawn once more with std
    0.02 / sqrt(2 * n_layer). ``record`` logged those writes on meta; ``replay_init`` makes
    every draw again from a generator seeded with ``seed`` into a scratch tensor (the CPU
    generator cannot skip ahead, so draws nobody here needs are made and dropped, one
    tensor at a time), and at each parameter's last write we copy this rank's slice into it
    (``_copy_slice``, what ``LocalModel.local_tensor`` gives: the ep and tp slice, vocabulary
    padding as zeros; the untied head copy on the last stage takes the embedding's value).
    Peak memory beyond the local parameters: one full tensor on the CPU. The global RNG is
    not touched (the engine reseeds it for dropout right after). With ``init_from`` the
    values come from that Hugging Face checkpoint instead (``_load_hf``, ``full_shapes``
    the unsharded shape of each parameter).
    """
    state = []  # buffers a module names in ``state_buffers``: training state, zero at start
    for c in local.chunks.values():
        for lname, layer in zip(c.names, c.layers):
            for mname, m in layer.named_modules(prefix=lname):
                for n, b in m._buffers.items():
                    if b is None:
                        continue
                    if n not in getattr(m, "state_buffers", ()):
                        raise ValueError(f"{local.description.kind}: buffer {mname}.{n} has "
                                         "no value when built on the meta device; compute it "
                                         "in forward instead")
                    state.append((m, n, f"{mname}.{n}"))
    materialise(local.chunks.values(), device)
    for m, n, _ in state:
        m._buffers[n].zero_()
    targets: dict[str, list[nn.Parameter]] = {}
    seen = set()
    for c in sorted(local.chunks):
        for name, p in local.chunks[c].model_parameters():
            if id(p) not in seen and not is_lora(name):  # adapters: _init_adapters
                seen.add(id(p))
                targets.setdefault(name, []).append(p)
    _init_adapters(local, seed)

    if init_from:  # the training-state buffers the arch names are checkpoint tensors too
        _load_hf(local, init_from, {**targets, **_hf_buffers(local, state)},
                 {**full_shapes, **{name: tuple(m._buffers[n].shape) for m, n, name in state}})
        return

    def sink(name: str, full: torch.Tensor) -> None:
        for p in targets[name]:
            src, ep_dim = full, getattr(p, "ep_dim", None)
            if ep_dim is not None:  # this ep rank's experts, then their tp slice
                n = p.shape[ep_dim]
                src = full.narrow(ep_dim, local.ep.rank * n, n)
            _copy_slice(p.detach(), src, getattr(p, "tp_dim", None), local.tp.rank)

    replay_init(record, seed, list(targets), sink)


@torch.no_grad()
def _hf_buffers(local: LocalModel, state: list) -> dict[str, list[torch.Tensor]]:
    """Of the training-state buffers ``state`` ((module, buffer, full name): replicated, whole
    on every rank), those the description's arch maps to a checkpoint tensor
    (``models.hf.HFArch``: DeepSeek-V3's routing bias)."""
    hf = local.description.hf
    out = {}
    for m, n, name in state:
        try:
            if hf is not None:
                hf.tensor(name)
                out[name] = [m._buffers[n]]
        except KeyError:
            continue
    return out


def _load_hf(local: LocalModel, path: str, targets: dict[str, list[nn.Parameter]],
             full_shapes: dict[str, tuple[int, ...]]) -> None:
    """Fill ``targets`` (full model name -> this rank's parameters of that name) from the
    Hugging Face checkpoint at ``path``: for each, the description's arch
    (``ModelDescription.hf``) names the checkpoint tensors and how ours lies in them
    (transposed, a piece of a packed tensor, one tensor per expert), and only this rank's
    block is read (``safetensors`` slicing): its experts along ``ep_dim``, its slice along
    ``tp_dim``; vocabulary padding rows are zero; the head tied to the embedding (one
    parameter at pp = 1, a copy on the last stage otherwise) reads the embedding's tensor. Values are cast to the parameter's dtype (fp32 here: the masters
    are made from them)."""
    from shardwise.base.errors import CheckpointError
    from shardwise.checkpoint.hf import SafetensorsDir, read_config

    # the checkpoint's own arch when it holds the model (Phi-3's packed Q/K/V, which a Llama
    # config does not name), else the description's; under the names the files hold
    files = SafetensorsDir(path)
    try:
        d = local.description.with_checkpoint_arch(read_config(path), files)
        if d.hf is None:
            raise ValueError(f"model.init_from: model.kind={d.kind!r} has no Hugging Face "
                             "mapping (its ModelDescription.hf is None)")
        for name, params in targets.items():
            src = d.tied[0] if d.tied is not None and name == d.tied[1] else name
            spec = d.hf.tensor(src)
            shape = full_shapes[src]  # unsharded
            for hf_name, want in spec.hf_shapes(shape).items():
                if files.shape(hf_name) != want:
                    raise CheckpointError(f"{path}: {hf_name} has shape "
                                          f"{list(files.shape(hf_name))}, config.json implies "
                                          f"{list(want)}")
            for p in params:
                dst = p.detach()
                region = [(0, n) for n in shape]  # (start, length) of ours this rank holds
                ep_dim, tp_dim = getattr(p, "ep_dim", None), getattr(p, "tp_dim", None)
                if ep_dim is not None:  # this ep rank's experts
                    region[ep_dim] = (local.ep.rank * dst.shape[ep_dim], dst.shape[ep_dim])
                if tp_dim is not None:  # this tp rank's rows, short of vocabulary padding
                    n = dst.shape[tp_dim]
                    have = max(0, min(n, shape[tp_dim] - local.tp.rank * n))
                    region[tp_dim] = (local.tp.rank * n, have)
                    if have < n:
                        dst.narrow(tp_dim, have, n - have).zero_()
                    if not have:
                        continue
                    dst = dst.narrow(tp_dim, 0, have)
                for hf_name, index, where in spec.reads(shape, tuple(region)):
                    dst[where].copy_(spec.to_ours(files.read(hf_name, index)))
    finally:
        files.close()


def _copy_slice(dst: torch.Tensor, full: torch.Tensor, dim: int | None, rank: int) -> None:
    """``dst`` := this rank's slice of ``full`` along ``dim`` (all of it when ``dim`` is None),
    rows past the end of ``full`` (vocabulary padding) zero: ``LocalModel.local_tensor``
    without its padded and sliced copies, so nothing beyond ``full`` is allocated."""
    if dim is None:
        dst.copy_(full)
        return
    n = dst.shape[dim]
    start = rank * n
    have = max(0, min(n, full.shape[dim] - start))
    if have:
        dst.narrow(dim, 0, have).copy_(full.narrow(dim, start, have))
    if have < n:
        dst.narrow(dim, have, n - have).zero_()


def _one_at_a_time(layers: list[tuple[str, nn.Module]], device: torch.device | None = None):
    """Each meta layer materialised in turn, for ``profile_layers``, then moved to
    ``device`` (None: the CPU; CUDA when training there, so stages are balanced by the
    GPU's times, not the host's): its timing only, so any finite values do (normal(0, 0.02)
    from a private CPU generator); one layer is alive at a time."""
    g = torch.Generator().manual_seed(0)
    for _, m in layers:
        m = copy.deepcopy(m)
        materialise([m], torch.device("cpu"))
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0.0, 0.02, generator=g)
        yield m.to(device) if device is not None else m
        del m


def lm_loss_fp32(logits: torch.Tensor, targets: torch.Tensor,
                 denominator: float | None = None) -> torch.Tensor:
    """Cross-entropy in nats, computed in fp32 (as ``GPT.forward`` and ``Llama.forward``):
    the sum over target tokens (``IGNORE_INDEX`` targets, a loss mask, are not) divided by
    ``denominator`` (default ``targets.numel()``: with no mask the plain mean, bit for bit)."""
    n = float(targets.numel() if denominator is None else denominator)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum") / n


def _vocab_parallel_loss(tp: RankGroup, vocab_size: int) -> Callable:
    def loss(logits: torch.Tensor, targets: torch.Tensor,
             denominator: float | None = None) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, tp, vocab_size, tag="head.loss",
                                            denominator=denominator)
    return loss
