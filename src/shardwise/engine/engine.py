"""One engine for every model and layout: dp x pp x cp x tp (x ep), ZeRO 0-3, fp32 / bf16 / fp16
(/ fp8: bf16 with torchao's float8 Linear layers, ``parallel.float8``).

``Engine(model, topology, cfg, device)`` (``cfg``: a ``Config`` or an ``EngineConfig``, the
view holding its sections) composes, once, for any model described by a
``models.description.ModelDescription`` (``model`` is one, or a registered config such as
``GPTConfig`` or ``LlamaConfig``; nothing here imports a model), the steps of
``engine.parallelize`` in order (``Engine._parallelize``):

1. ``engine.model.build_local_model``: the model on the meta device, this rank's pipeline
   chunks kept, sharded by its tensor-parallel plan and split by expert (``apply_tp``,
   ``apply_ep``), then only those materialised, each equal to its slice of the model built
   from the seed (no rank holds the whole model);
2. with cp > 1, ``apply_cp``: every batch cut to this rank's chunks of each sequence (i and
   2cp-1-i); each micro-batch's ``models.sequence`` shard (its tokens' true positions and
   ring attention; under ``attention_mask = "block_causal"`` its document ids too, from its
   tokens on every stage) is set around every forward of the chunks on it (``Executor``);
3. ``apply_float8``, ``apply_ac``, ``apply_compile`` when the config asks;
4. ``apply_dp``: the chunks wrapped for dp (``engine.sync``: ZeRO-0 buckets, ZeRO-1/2
   reduce-scatter, ZeRO-3 gather/free units), over the dp x cp replicas of every parameter
   (``dp_cp``; under HSDP ZeRO 1-3 over one replica's ``dp_shard_cp``, then averaged across
   replicas); under ep the expert parameters apart, over ``ep_dp`` x cp (``ep_dp_cp``);

then ``engine.optimizer.DistributedOptimizer`` (fp32 masters, one global norm and overflow
flag, AdamW) and a pipeline schedule (``pipeline.schedules``; pp = 1 is the one-stage case,
and its micro-batch loop is gradient accumulation) run by ``pipeline.executor.Executor``.

``train_step`` runs one step of the schedule; ``loss`` and ``generate`` run forward-only
passes through the same chunks and executor (``Executor.forward``). Nothing here branches on the layout:
each part answers the same calls whatever it holds. A model with mixture-of-experts layers
(``models.description``: modules with ``pop_router_stats``) also reports, per step, their
auxiliary loss and expert load (``train_step``), and after each step hands each such layer
that has ``update_bias`` the global load of its experts (auxiliary-loss-free balancing: every
rank holding the layer applies the same update to its copy of the bias).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise import comm
from shardwise.base.config import (
    Config,
    LoRAConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
    batch_refusal,
    cp_heads,
    pipedream_refusal,
    split_backward_refusal,
)
from shardwise.comm.replicas import NO_REPLICAS, Replicas
from shardwise.data.sampler import IGNORE_INDEX
from shardwise.engine.model import LocalModel, build_local_model
from shardwise.engine.optimizer import DistributedOptimizer
from shardwise.engine.parallelize import (
    apply_ac,
    apply_activation_offload,
    apply_compile,
    apply_cp,
    apply_dp,
    apply_float8,
    block_numbers,
    layers_of,
)
from shardwise.models.description import ModelDescription, describe
from shardwise.models.sampling import generate
from shardwise.models.sequence import SequenceShard, document_ids
from shardwise.parallel.context import ContextParallel
from shardwise.parallel.pipeline import timeline
from shardwise.parallel.pipeline.executor import Executor
from shardwise.parallel.pipeline.schedules import ScheduleError, schedule
from shardwise.parallel.pipeline.stream import stream
from shardwise.parallel.precision import DTYPES, DynamicLossScaler
from shardwise.parallel.tensor_parallel.group import RankGroup
from shardwise.parallel.tensor_parallel.layers import gather_tensor
from shardwise.parallel.zero.memory import storage_bytes_once

# one line: block_causal's documents end at the tokenizer's end-of-text id
BLOCK_CAUSAL_NEEDS_EOS = ("model.attention_mask='block_causal': the tokenizer has no "
                          "end-of-text id to end documents at (the character tokenizer has "
                          "none); train on data from `shardwise prepare` with a tokenizer "
                          "that has one, or set model.attention_mask = \"causal\"")

_STEP_STRIDE = 1_000_003  # prime, above any dropout_seed spread: no two (rank, step) seeds meet


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The config sections the engine reads, held by reference (no field is copied):
    ``parallel`` (schedule, micro-batches, ZeRO, buckets, recompute), ``optimizer``
    (AdamW's lr, betas, weight decay, clip), ``training`` (precision, seed, global batch in
    sequences, compile), ``lora`` (low-rank adapters, the base frozen), and what a run
    adds: ``seq_len`` (tokens per sequence: the
    ``model.block_size`` of the run), ``init_from`` (a Hugging Face checkpoint directory
    the weights come from; "": drawn from ``training.seed``) and ``eos_id`` (the tokenizer's
    end-of-text id: under ``attention_mask = "block_causal"`` it ends documents).

    ``EngineConfig.of(cfg)`` reads a whole ``Config``, whose rules were checked at the door;
    built by hand, each section is a section or a dict of its fields
    (``EngineConfig(seq_len=16, parallel={"micro_batches": 2})``), and only each section's
    own rules are checked (pydantic's ``ValidationError``, a ``ValueError``)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    seq_len: int
    init_from: str = ""
    eos_id: int | None = None

    def __post_init__(self):
        for name, section in (("parallel", ParallelConfig), ("optimizer", OptimizerConfig),
                              ("training", TrainingConfig), ("lora", LoRAConfig)):
            value = getattr(self, name)
            if not isinstance(value, section):  # a dict of the section's fields
                object.__setattr__(self, name, section.model_validate(value))

    @classmethod
    def of(cls, cfg: Config, eos_id: int | None = None) -> "EngineConfig":
        """The view of ``cfg``; ``eos_id``: the run's tokenizer's end-of-text id (None: it
        has none)."""
        return cls(parallel=cfg.parallel, optimizer=cfg.optimizer, training=cfg.training,
                   lora=cfg.lora, seq_len=cfg.model.block_size,
                   init_from=cfg.model.init_from.removeprefix("hf:"), eos_id=eos_id)


def settle(info: dict) -> dict:
    """``info`` with every 0-d tensor read into a Python float (one host synchronisation
    for all of them) and every larger one into nested lists (``expert_load``)."""
    keys = [k for k, v in info.items() if isinstance(v, torch.Tensor) and v.dim() == 0]
    more = {k: v.detach().cpu().tolist() for k, v in info.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not keys:
        return {**info, **more}
    values = torch.stack([info[k].detach().double() for k in keys]).tolist()
    return {**info, **dict(zip(keys, values)), **more}


class Engine:
    """This rank's share of a model trained in any layout (see module docstring).

    ``model``: a ``ModelDescription`` or a registered config (``GPTConfig``, ``LlamaConfig``,
    a user's). ``cfg``: a ``Config`` (``Config.from_dict({...})``) or an ``EngineConfig``.
    ``measure_memory``: meter the bytes saved for backward (``executor.meter.peak``).
    ``replicas``: the replica groups outside this job (per-step fault tolerance: a
    ``comm.torchft_replicas.TorchftReplicas``; default none): the synced gradients are
    averaged across them, and the optimizer steps only where their ``commit()`` vote says so
    (otherwise ``committed`` is False and the step is not counted: the caller redoes it).

    Raises ``ValueError`` (one line) for what the config cannot see: a schedule that cannot
    be built, more chunks than layers, sizes tp does not divide in the model, micro-batches
    that do not divide this topology's per-replica batch, PipeDream with clipping (hand-built
    sections) or with a tied embedding across stages, ZeRO-3 with a parameter shared by two
    chunks of one rank, cp > 1 with a sequence length 2 cp does not divide or a model whose
    description does not read positions through ``models.sequence``.
    """

    def __init__(self, model, topology, cfg: Config | EngineConfig,
                 device: torch.device | None = None, *, measure_memory: bool = False,
                 replicas: Replicas = NO_REPLICAS):
        cfg = EngineConfig.of(cfg) if isinstance(cfg, Config) else cfg
        self.cfg, self.topology, self.replicas = cfg, topology, replicas
        par, opt, tr = cfg.parallel, cfg.optimizer, cfg.training
        self.device = device or torch.device("cpu")
        self.distributed = dist.is_available() and dist.is_initialized()
        groups = topology.groups if self.distributed else None
        pp, v, kind, m = topology.pp, par.chunks_per_rank, par.schedule, par.micro_batches
        local_batch = tr.global_batch_size // topology.dp
        # the topology and the sections may be built by hand, apart from a Config's checks
        if batch_refusal(tr.global_batch_size, topology.dp, m):
            raise ValueError(batch_refusal(tr.global_batch_size, topology.dp, m))
        if split_backward_refusal(kind, par.zero, par.recompute):
            raise ValueError(split_backward_refusal(kind, par.zero, par.recompute))
        why = pipedream_refusal(kind, pp, describe(model).tied is not None, opt.grad_clip)
        if why:
            raise ValueError(why)
        try:
            self.schedule = schedule(kind, pp, m, v)
            self.stream = stream(pp, m) if kind == "pipedream" else None
        except ScheduleError as exc:
            raise ValueError(str(exc)) from None
        self.dtype = DTYPES[tr.precision]
        self.pp_rank = topology.pp_rank
        self.pp_ranks = topology.axis_ranks("pp")
        self.pp_group = groups.pp if groups is not None else None
        # the replicas of every parameter: dp x cp (cp splits tokens, not weights)
        self.grad_group = groups.dp_cp if groups is not None else None
        # HSDP: ZeRO shards over one replica's dp_shard x cp ranks, then averages across the
        # replicas (``comm.replicas``); with dp_replicate = 1 this is the dp_cp group
        self.shard_group = groups.dp_shard_cp if groups is not None else None
        self.tp = (RankGroup.from_topology(topology, sequence_parallel=par.sequence_parallel)
                   if groups is not None and topology.tp > 1 else RankGroup())
        self.ep = (RankGroup.from_topology(topology, "ep")
                   if groups is not None and topology.ep > 1 else RankGroup(axis="ep"))
        # dropout: the same stream on the tp ranks of a replica (replicated regions), one per
        # dp replica and stage; tp-sharded regions add the tp rank (Megatron's RNG tracker)
        self.dropout_seed = tr.seed + 1000 * (topology.dp_rank + 1) + 100 * topology.pp_rank
        self.loss_scaler = (DynamicLossScaler(tr.initial_loss_scale)
                            if tr.precision == "fp16" and tr.loss_scaling else None)
        self._parallelize(model, local_batch)
        self.block_causal = self.description.attention_mask == "block_causal"
        if self.block_causal and cfg.eos_id is None:
            raise ValueError(BLOCK_CAUSAL_NEEDS_EOS)
        tied_peer = None
        if self.local.tied and pp > 1:
            other = pp - 1 if self.local.has_first else 0
            tied_peer = topology.rank_of(topology.dp_rank, other, topology.tp_rank,
                                         cp=topology.cp_rank)
        self.optimizer = DistributedOptimizer(
            self.sync, tp=self.tp, sequence_parallel=par.sequence_parallel, lr=opt.lr,
            betas=(opt.beta1, opt.beta2), weight_decay=opt.weight_decay,
            loss_scaler=self.loss_scaler, tied_peer=tied_peer, tied_names=self.local.tied,
            tied_counted=self.local.has_first, global_norm=not self.schedule.weight_stashing,
            fused=(self.device.type == "cuda" if opt.fused is None else opt.fused)
            and opt.state_dtype == "fp32", state_dtype=DTYPES[opt.state_dtype])
        seq = cfg.seq_len // topology.cp  # this rank's tokens of each sequence
        seq = seq // self.tp.size if self.tp.sequence_parallel else seq
        self.act_shape = (local_batch // m, seq, self.description.hidden_size)
        self._train_loss = self.local.loss_fn  # as built (compiled under training.compile)
        self.executor = Executor(
            self.schedule, self.pp_rank, self.chunks, self.pp_ranks, self.act_shape,
            loss_fn=self._target_loss, on_step=self._optimizer_step, dtype=self.dtype,
            group=self.pp_group, recompute=par.recompute == "stage", grad_sync=self.sync,
            device=self.device, measure_memory=measure_memory,
            loss_scale=(lambda: self.loss_scaler.scale) if self.loss_scaler else (lambda: 1.0))
        self.stream_step = 0
        self._per_micro_batch: float | None = None  # the loss's denominator (train_step)
        self.step = 0  # optimizer steps taken (restored on resume): seeds dropout per step
        self.committed = True  # whether the last step's vote let the optimizer step
        self.last_step: dict = {"grad_norm": 0.0, "skipped": False}
        self.sync.zero_grad()

    # -- composition ----------------------------------------------------------------------
    def _parallelize(self, model, local_batch: int) -> None:
        """The parallelization steps in order (``engine.parallelize``): split on meta, tp and
        ep, materialise this rank's shards (``build_local_model``), then cp, float8,
        selective recomputation, compile, and the dp sync over the chunks."""
        cfg, topo = self.cfg, self.topology
        par, tr = cfg.parallel, cfg.training
        self.local: LocalModel = build_local_model(  # apply_tp, apply_ep on meta inside
            model, pp=topo.pp, pp_rank=self.pp_rank,
            chunk_ids=self.schedule.chunks_of(self.pp_rank), n_chunks=topo.pp * par.chunks_per_rank,
            tp=self.tp, seed=tr.seed, dropout_seed=self.dropout_seed, device=self.device,
            partition_by=par.partition,
            time_sample=(local_batch // par.micro_batches, cfg.seq_len),
            average=self._average, ep=self.ep, all_to_all=par.all_to_all,
            init_from=cfg.init_from or None, lora=cfg.lora)
        self.description: ModelDescription = self.local.description
        for _, q in self.local.frozen_parameters():  # LoRA's base: kept in the compute dtype
            q.data = q.data.to(self.dtype)
        assert not (par.sequence_parallel and (cfg.seq_len // topo.cp) % topo.tp), \
            "config: sequence parallelism needs tp to divide model.block_size / cp"
        self.cp: ContextParallel | None = apply_cp(self.description, topo, cfg.seq_len,
                                                   self.device, self.distributed,
                                                   cp_heads(par.cp_comm, topo.cp, par.cp_a2a),
                                                   par.all_to_all)
        torch.manual_seed(self.dropout_seed)
        layers = layers_of(self.local.chunks)
        self.fp8_layers: list[str] = (
            apply_float8(layers, self.description, tr.fp8_recipe, self.device, self.tp)
            if tr.precision == "fp8" else [])
        self.checkpointed: list[str] = []  # the layers apply_ac checkpointed
        if par.recompute in ("selective", "full"):
            self.checkpointed = apply_ac(
                layers, self.device, self.local.rng, par.recompute,
                block_numbers(self.local), par.recompute_every)
        self.offloaded: list[str] = (  # the blocks whose saved tensors wait on the host
            apply_activation_offload(layers, self.device, block_numbers(self.local))
            if par.activation_offload else [])
        if tr.compile:
            apply_compile(layers)
            # Inductor fuses the logits' cast into the cross-entropy instead of writing fp32
            # logits out
            self.local.loss_fn = torch.compile(self.local.loss_fn)
        self.chunks: dict[int, nn.Module] = dict(self.local.chunks)
        self.sync = apply_dp(self.local, self.chunks, topo, par, dtype=self.dtype,
                             loss_scaler=self.loss_scaler, distributed=self.distributed,
                             replicas=self.replicas, offload=tr.offload != "none",
                             offload_params=tr.offload == "optimizer+params")

    def _sequence_shards(self, idx: torch.Tensor, m: int) -> list[SequenceShard | None] | None:
        """The ``models.sequence`` shard of each of the ``m`` micro-batches of ``idx`` (B, T),
        this replica's whole sequences, for every stage (``Executor.run(shards=)``): context
        parallelism's positions and ring (``ContextParallel.current``, after ``shard``) and,
        under ``attention_mask = "block_causal"``, the micro-batch's document ids from its
        tokens (``models.sequence.document_ids``, the end-of-text token closing its
        document). None when neither applies: the chunks run as a single process does."""
        ring = self.cp.current if self.cp is not None else None
        if not self.block_causal:
            return None if ring is None else [ring] * m
        base = ring if ring is not None else SequenceShard()
        return [replace(base, documents=d)
                for d in document_ids(idx, self.cfg.eos_id).chunk(m)]

    def _average(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed and dist.get_world_size() > 1:  # every rank must cut alike
            comm.all_reduce(t, op="mean")
        return t

    @property
    def partition(self):
        """How the layers were cut into chunks (``pipeline.partition.Partition``)."""
        return self.local.partition

    def save_timeline(self, run_dir, title: str = "") -> None:
        """Write this rank's events of the last step to ``RUN_DIR/timeline/rank{r}.json``
        (draw them with ``shardwise timeline RUN_DIR``)."""
        p = self.cfg.parallel
        meta = {"title": title or f"{p.schedule} pp={self.topology.pp} m={p.micro_batches} "
                f"v={p.chunks_per_rank}", "pp_rank": self.pp_rank,
                "dp_rank": self.topology.dp_rank}
        timeline.save(run_dir, self.topology.rank,
                      timeline.from_executor(self.executor, self.topology.rank), meta)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their full model names (tp-local shapes)."""
        return self.local.named_parameters()

    def full_parameters(self):
        """A context in which every local parameter is materialised (ZeRO-3 gathers them;
        collective over dp x cp)."""
        return self.sync.full_parameters()

    def full_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters as the single-process model holds them: full model
        names, unsharded over tp (vocabulary padding dropped), gathered over dp under ZeRO-3,
        compute dtype, copies. A tied head copy on the last stage is left out (the
        embedding's is the same tensor). Collective over tp (and dp under ZeRO-3): every
        rank calls it. For parity checks and reports (``examples/own_decoder.py``)."""
        from shardwise.engine.state import model_tensors

        with self.full_parameters():
            return model_tensors(self)

    def memory_bytes(self) -> dict:
        """Bytes this rank holds for ``params`` (compute-dtype parameters and shards),
        ``grads`` (buckets, gradient shards; without buckets, at dp = 1, the gradients kept
        between steps: measured once they exist, their parameters' bytes before the first
        backward) and ``optimizer`` (fp32 masters that are not the parameters themselves,
        AdamW's two moments: measured once they exist, 8 bytes per master element (4 in
        bf16, ``optimizer.state_dtype``) before the first step), each storage counted once;
        ``total`` their sum, ``host`` the part of it in host memory (``training.offload``)."""
        seen: set = set()
        params = [q for _, q in self.named_parameters()]
        frozen = [q for _, q in self.local.frozen_parameters()]  # LoRA's base
        out = {"params": sum(storage_bytes_once(seen, q) for q in params + frozen)}
        out["params"] += sum(storage_bytes_once(seen, t) for t in self.sync.param_shards())
        # ZeRO-1's shards are views into its buckets: a storage is counted once, whole
        grads = [q.grad for q in params] + list(self.sync.grad_shards())
        out["grads"] = sum(storage_bytes_once(seen, g) for g in grads)
        out["grads"] += self.sync.future_grad_bytes()  # no buckets: none made yet
        opt = sum(storage_bytes_once(seen, m) for m in self.sync.pieces)
        state = self.optimizer.optimizer.state
        for m in self.sync.pieces:
            if m in state:
                opt += sum(storage_bytes_once(seen, state[m].get(k))
                           for k in ("exp_avg", "exp_avg_sq"))
            else:  # two moments of optimizer.state_dtype's bytes an element
                opt += 2 * DTYPES[self.cfg.optimizer.state_dtype].itemsize * m.numel()
        out["optimizer"] = opt
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        # training.offload: the optimizer's bytes live in host memory, with
        # "optimizer+params" ZeRO-3's compute-dtype shards too (in fp32 the masters are them)
        off = self.cfg.training.offload
        out["host"] = (0 if off == "none" else opt) + (
            sum(t.untyped_storage().nbytes() for t in self.sync.param_shards())
            if off == "optimizer+params" else 0)
        return out

    # -- training -------------------------------------------------------------------------
    def _optimizer_step(self) -> None:
        self.sync.finish()  # in-job reduction, then the mean across the replicas
        self.committed = self.replicas.commit()  # fault tolerance: every live replica voted
        if self.committed:
            self.last_step = self.optimizer.step(self.cfg.optimizer.grad_clip)
        self.sync.zero_grad()

    def _target_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss: its targets' summed loss over the global batch's target count
        per micro-batch and rank, so that the executor's 1/m and the dp x cp mean of gradients
        and losses make the mean over the global batch's targets in every layout."""
        return self._train_loss(logits, targets, self._per_micro_batch)

    def train_step(self, idx: torch.Tensor, targets: torch.Tensor, sync: bool = True,
                   n_targets: int | None = None) -> dict:
        """One optimizer step on this dp replica's batch ``idx``, ``targets`` (B, T) int64
        (whole sequences: with cp > 1 each rank keeps its chunks of them; under
        ``block_causal`` every stage reads ``idx`` for its document ids, so every rank of
        the replica must be given the same tokens).
        Returns ``{"loss", "grad_norm", "skipped"}`` (and, with ZeRO-0 buckets,
        ``buckets_overlapped``: [launched before the schedule's end, buckets]); the loss is the
        mean over micro-batches, cp shards and dp replicas, the same on every rank; only
        ``{"committed": False}`` when the replicas' vote did not let the optimizer step (fault
        tolerance: ``self.step`` unchanged, the step is redone). ``n_targets``: the count of
        targets (not ``IGNORE_INDEX``) in the global batch, the loss's denominator, when the
        data carry a loss mask (None: every token, ``B x T x dp``). ``sync=True``: loss
        and norm as Python floats (the host waits for the device); ``sync=False``: as 0-d
        tensors on the device, so a loop can run ahead and read them at its logging interval
        (``settle`` converts such a dict)."""
        m = self.schedule.m
        self._seed_step()
        if n_targets is None:  # every token a target: the plain mean, bit for bit
            n_targets = targets.numel() * self.topology.dp
        self._per_micro_batch = n_targets / (m * self.topology.dp_cp)
        whole = idx
        if self.cp is not None:  # chunks i and 2cp-1-i of every sequence
            idx, targets = self.cp.shard(idx, targets)
        shards = self._sequence_shards(whole, m)
        # the auxiliary losses' share of the gradient; under SP each tp rank's, 1 / tp of it:
        # every rank computes the whole sequences' loss in its "moe" region and the router's
        # and the input's gradients are summed over tp (optimizer, reduce-scatter)
        share = self.tp.size if self.tp.sequence_parallel else 1
        for _, layer in self.local.moe_local:
            layer.aux_grad_scale = (self.loss_scaler.scale if self.loss_scaler else 1.0) / (m * share)
        inputs, tgts = list(idx.chunk(m)), list(targets.chunk(m))
        if self.stream is None:
            losses = self.executor.run(inputs, tgts, shards=shards)
        else:  # PipeDream: this step's segment of one endless stream
            k = self.stream_step
            losses = self.executor.run(inputs, tgts, self.stream.segment(k)[self.pp_rank],
                                       first_mb=k * m, shards=shards)
            self.stream_step += 1
        total = (torch.stack(losses).double().sum() / m if losses
                 else torch.zeros((), dtype=torch.float64, device=self.device))
        if not self.committed:  # not counted: the caller redoes this step
            return {"committed": False}
        self.step += 1
        router = self._router_stats(m)
        if router:  # auxiliary-loss-free balancing: the step's global load moves the biases
            for i, layer in self.local.moe_local:
                update = getattr(layer, "update_bias", None)
                if callable(update):
                    update(router["expert_load"][i])
        info = {"loss": self._share_loss(total), **self.last_step, **router}
        overlapped = self.sync.buckets_overlapped()
        if overlapped is not None:  # our DDP's buckets: how many started before backward ended
            info["buckets_overlapped"] = overlapped
        return settle(info) if sync else info

    def _router_stats(self, m: int) -> dict:
        """The mixture-of-experts layers' statistics of this step, the same on every rank:
        ``aux_loss`` (0-d: the sum over layers of each one's coef-weighted auxiliary loss,
        averaged over micro-batches, cp ranks and dp replicas, as one process computes it
        on the global batch: under cp each rank's is the local share whose mean over the
        sequence's cp ranks is the whole sequences' loss, ``models.moe``),
        ``expert_load`` (layers, E) int64: assignments routed to each expert over the
        global batch (each cp rank counts its own tokens), and when the description has a
        capacity factor (``capacity_factor`` > 0) ``expert_dropped`` (0-d float64:
        assignments over capacity, summed over layers and the global batch). One all-reduce
        over the world (tp rank 0 of each replica counts; stages hold other layers). Empty
        without such layers."""
        layers = self.local.moe_layers
        if not layers:
            return {}
        e = self.description.n_experts
        t = torch.zeros(len(layers), e + 2, dtype=torch.float64, device=self.device)
        for i, layer in self.local.moe_local:
            got = layer.pop_router_stats()
            if got is not None and self.tp.rank == 0:
                t[i, 0] = got["aux_loss"].double() / (m * self.topology.dp_cp)
                t[i, 1] = got["dropped"].double()
                t[i, 2:] = got["load"].double()
        if self.distributed and dist.get_world_size() > 1:
            comm.all_reduce(t, check=False)
        out = {"aux_loss": t[:, 0].sum(), "expert_load": t[:, 2:].round().long()}
        if self.description.capacity_factor > 0:
            out["expert_dropped"] = t[:, 1].sum()
        return out

    def _seed_step(self) -> None:
        """Dropout streams as a function of (seed, coordinates, step) alone: a run resumed
        at step k in any layout draws what an uninterrupted run in that layout draws, with
        no random state in the checkpoint (JAX's ``fold_in(key, step)``, in seeds)."""
        base = self.dropout_seed + _STEP_STRIDE * self.step
        if self.local.rng is not None:
            self.local.rng.reseed(base)
        # the generators dropout draws from: the host's and the run's device's, not
        # torch.manual_seed's every backend (on a CPU-only build it queues a lazy CUDA, XPU
        # and MTIA seed with a formatted stack each step: 59 us a call here, against 1 us)
        torch.default_generator.manual_seed(base)
        if self.device.type == "cuda":
            torch.cuda.manual_seed_all(base)

    def drain(self) -> None:
        """PipeDream: finish the micro-batches still in flight (before a checkpoint and at
        the end). Nothing to do for flush schedules."""
        if self.stream is None or self.stream_step == 0:
            return
        self.executor.run(None, None, self.stream.drain(self.stream_step - 1)[self.pp_rank])
        self.stream_step = 0

    def _share_loss(self, value: torch.Tensor) -> torch.Tensor:
        """The last stage's value (0-d float64) on every rank (broadcast over pp), averaged
        over dp and cp (each cp rank's is the mean over as many tokens); stays on the device."""
        if not self.distributed:
            return value
        t = value.reshape(1).to(self.device)
        if self.topology.pp > 1:
            last = self.pp_ranks[self.schedule.rank_of(self.local.n_chunks - 1)]
            comm.broadcast(t, src=last, group=self.pp_group, check=False,  # fixed shape
                           algorithm="auto")
        if self.topology.dp_cp > 1:
            comm.all_reduce(t, op="mean", group=self.grad_group, check=False)
        return t[0]

    # -- forward only: evaluation and generation ------------------------------------------
    def _logits(self, idx: torch.Tensor, shard: SequenceShard | None = None
                ) -> torch.Tensor | None:
        """Forward of ``idx`` (B, T) through the stages in order (``Executor.forward``: one
        micro-batch in flight), inside ``models.sequence.use(shard)`` when a shard is given
        (None: whole sequences, plain causal). Returns this tp rank's logits (B, T, V_pad /
        tp) on the last stage, None elsewhere. Every rank of the replica must call it."""
        B, T = idx.shape
        seq = T // self.tp.size if self.tp.sequence_parallel else T
        return self.executor.forward(idx, (B, seq, self.description.hidden_size), shard)

    @torch.no_grad()
    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean cross-entropy (nats per token) of one batch (B, T) of whole sequences, on every
        rank of the replica (with cp > 1 each rank evaluates its chunks, then the cp ranks
        average)."""
        return self._replica_loss(idx, targets, None, "mean")

    def loss_sum(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        """Cross-entropy summed over the target tokens (nats; ``IGNORE_INDEX`` targets, a
        loss mask's, skipped) of one batch (B, T) of whole sequences, and their count, on
        every rank of the replica (with cp > 1 the cp ranks' sums added)."""
        n = int((targets != IGNORE_INDEX).sum())
        return (self._replica_loss(idx, targets, 1.0, "sum") if n else 0.0), n

    def _replica_loss(self, idx: torch.Tensor, targets: torch.Tensor,
                      denominator: float | None, cp_op: str) -> float:
        whole = idx
        if self.cp is not None:
            idx, targets = self.cp.shard(idx, targets)
        shards = self._sequence_shards(whole, 1)
        with self.evaluating():
            logits = self._logits(idx, shards[0] if shards else None)
            value = (float(self.local.loss_fn(logits, targets, denominator))
                     if logits is not None else 0.0)
        if self.distributed and self.topology.pp > 1:
            t = torch.tensor([value], dtype=torch.float64, device=self.device)
            last = self.pp_ranks[self.schedule.rank_of(self.local.n_chunks - 1)]
            comm.broadcast(t, src=last, group=self.pp_group, algorithm="auto")
            value = float(t)
        if self.cp is not None and self.distributed:
            t = torch.tensor([value], dtype=torch.float64, device=self.device)
            comm.all_reduce(t, op=cp_op, group=self.topology.groups.cp, check=False)
            value = float(t)
        return value

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, generator: torch.Generator | None = None,
                 vocab_size: int | None = None, **sampling) -> torch.Tensor:
        """``GPT.generate`` / ``Llama.generate`` on this replica: (B, T0) -> (B, T0 + new_tokens), the same ids on
        every rank of the replica (the last stage samples; tp ranks draw alike from
        ``generator``; the token is broadcast over pp). Under sequence parallelism the
        context is right-padded to a multiple of tp (causal attention ignores the pads). With
        cp > 1 every cp rank runs the whole context itself (no ring: contexts of any length).
        A context is one document: no document mask, even under ``block_causal`` (plain
        causal attention; an end-of-text token inside a prompt is attended across).
        ``vocab_size``: sample among the first ``vocab_size`` ids only (a tokenizer smaller
        than the model's vocabulary; None: all of it). ``sampling``: ``temperature``,
        ``top_k`` as ``models.sampling.generate``."""
        vocab = min(vocab_size or self.description.vocab_size, self.description.vocab_size)
        last = self.pp_ranks[self.schedule.rank_of(self.local.n_chunks - 1)]

        def logits_of(ctx):  # (B, T, V) on the last stage, gathered over tp; None elsewhere
            logits = self._logits(ctx)
            if logits is None:
                return None
            return gather_tensor(logits, -1, self.tp)[..., :vocab]

        share = None
        if self.distributed and self.topology.pp > 1:
            share = lambda nxt: comm.broadcast(nxt, src=last, group=self.pp_group,
                                               algorithm="auto")
        with self.evaluating():
            return generate(logits_of, idx, new_tokens, self.description.block_size,
                            pad_to=self.tp.size if self.tp.sequence_parallel else 1,
                            share=share, generator=generator, **sampling)

    @contextlib.contextmanager
    def evaluating(self):
        """A context in which this rank's chunks are in eval mode (no dropout); they are back
        in training mode when it ends, also on an exception."""
        for chunk in self.chunks.values():
            chunk.train(False)
        try:
            yield
        finally:
            for chunk in self.chunks.values():
                chunk.train(True)
