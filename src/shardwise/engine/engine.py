"""One engine for every model and layout: dp x pp x cp x tp (x ep), ZeRO 0-3, fp32 / bf16 / fp16
(/ fp8: bf16 with torchao's float8 Linear layers, ``parallel.float8``).

``Engine(model, topology, settings, device)`` composes, once, in this order, for any model
described by a ``models.description.ModelDescription`` (``model`` is one, or a registered
config such as ``GPTConfig`` or ``LlamaConfig``; nothing here imports a model):

1. ``engine.model.build_local_model``: the model on the meta device, this rank's pipeline
   chunks kept and sharded by its tensor-parallel plan, then only those materialised, each
   equal to its slice of the model built from the seed (no rank holds the whole model);
   with ep > 1 each rank keeps its experts (``parallel.experts``);
2. with cp > 1, ``parallel.context.ContextParallel``: every batch cut to this rank's chunks
   of each sequence (i and 2cp-1-i); each micro-batch's ``models.sequence`` shard (its
   tokens' true positions and ring attention; under ``attention_mask = "block_causal"``
   its document ids too, from its tokens on every stage) is set around every forward of
   the chunks on it (``Executor``; ``_logits`` for evaluation);
3. ``engine.sync``: the chunks wrapped for dp (ZeRO-0 buckets, ZeRO-1/2 reduce-scatter,
   ZeRO-3 gather/free units), over the dp x cp replicas of every parameter (``dp_cp``;
   under HSDP ZeRO 1-3 over one replica's ``dp_shard_cp``, then averaged across replicas);
   under ep the expert parameters apart, over their replicas ``ep_dp`` x cp (``ep_dp_cp``);
4. ``engine.optimizer.DistributedOptimizer``: fp32 masters, one global norm and overflow
   flag, AdamW;
5. a pipeline schedule (``pipeline.schedules``; pp = 1 is the one-stage case, and its
   micro-batch loop is gradient accumulation) run by ``pipeline.executor.Executor``.

``train_step`` runs one step of the schedule; ``loss`` and ``generate`` run forward-only
passes through the same chunks, stage after stage. Nothing here branches on the layout:
each part answers the same calls whatever it holds. A model with mixture-of-experts layers
(``models.description``: modules with ``pop_router_stats``) also reports, per step, their
auxiliary loss and expert load (``train_step``), and after each step hands each such layer
that has ``update_bias`` the global load of its experts (auxiliary-loss-free balancing: every
rank holding the layer applies the same update to its copy of the bias).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise import comm
from shardwise.comm.replicas import NO_REPLICAS, Replicas
from shardwise.engine.model import LocalModel, build_local_model, zero3_shared_reason
from shardwise.engine.optimizer import DistributedOptimizer
from shardwise.engine.sync import ReplicatedSync, SplitSync
from shardwise.models import sequence
from shardwise.models.description import ModelDescription, describe
from shardwise.models.sampling import generate
from shardwise.models.sequence import SequenceShard, document_ids
from shardwise.parallel.activation_checkpoint import CUDA_REFUSAL as SELECTIVE_ON_CUDA
from shardwise.parallel.activation_checkpoint import checkpoint_selectively
from shardwise.parallel.context import ContextParallel, Ring
from shardwise.parallel.experts import is_expert
from shardwise.parallel.pipeline import timeline
from shardwise.parallel.pipeline.executor import Executor
from shardwise.parallel.pipeline.schedules import ScheduleError, schedule
from shardwise.parallel.pipeline.stream import stream
from shardwise.parallel.precision import DTYPES, DynamicLossScaler
from shardwise.parallel.tensor_parallel.group import RankGroup
from shardwise.parallel.tensor_parallel.layers import gather_tensor
from shardwise.parallel.zero.memory import storage_bytes_once
from shardwise.parallel.zero.optimizer import ZeroDataParallel
from shardwise.parallel.zero.stage3 import ZeroStage3

# one line: block_causal's documents end at the tokenizer's end-of-text id
BLOCK_CAUSAL_NEEDS_EOS = ("model.attention_mask='block_causal': the tokenizer has no "
                          "end-of-text id to end documents at (the character tokenizer has "
                          "none); train on data from `shardwise prepare` with a tokenizer "
                          "that has one, or set model.attention_mask = \"causal\"")

_STEP_STRIDE = 1_000_003  # prime, above any dropout_seed spread: no two (rank, step) seeds meet


@dataclass(frozen=True)
class EngineSettings:
    """What the engine needs from the config (``from_config``); see ``config.ParallelConfig``."""

    schedule: str = "1f1b"
    micro_batches: int = 1
    chunks_per_rank: int = 1
    partition: str = "layers"
    recompute: bool | str = False  # True: the pipeline's full recomputation; "selective"
    sequence_parallel: bool = False
    zero: int = 0
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    allreduce: str = "auto"
    precision: str = "fp32"
    loss_scaling: bool = True
    initial_loss_scale: float = 65536.0
    lr: float = 3e-3
    betas: tuple = (0.9, 0.99)
    weight_decay: float = 0.1
    grad_clip: float = 0.0
    seed: int = 1337
    batch_size: int = 32   # global batch, sequences
    seq_len: int = 128
    measure_memory: bool = False  # meter saved-for-backward bytes (executor.meter.peak)
    fused: bool | None = None  # AdamW kernel; None: fused on CUDA, the per-tensor loop on CPU
    compile: bool = False  # torch.compile each transformer block
    all_to_all: str = "native"  # expert parallelism's all-to-all (comm.ALL_TO_ALL_ALGORITHMS)
    init_from: str = ""  # a Hugging Face checkpoint directory the weights come from; "": seed
    fp8_recipe: str = "tensorwise"  # precision = "fp8": torchao's scaling (parallel.float8)
    # the tokenizer's end-of-text id: under attention_mask = "block_causal" it ends a document
    eos_id: int | None = None

    @classmethod
    def from_config(cls, cfg, eos_id: int | None = None) -> "EngineSettings":
        """The settings of ``cfg``; ``eos_id``: the run's tokenizer's end-of-text id (None:
        it has none), which separates documents under ``model.attention_mask =
        "block_causal"``."""
        p, o, t = cfg.parallel, cfg.optimizer, cfg.training
        return cls(schedule=p.schedule, micro_batches=p.micro_batches,
                   chunks_per_rank=p.chunks_per_rank, partition=p.partition,
                   recompute=p.recompute, sequence_parallel=p.sequence_parallel, zero=p.zero,
                   bucket_mb=p.bucket_mb, first_bucket_mb=p.first_bucket_mb,
                   allreduce=p.allreduce, precision=t.precision, loss_scaling=t.loss_scaling,
                   initial_loss_scale=t.initial_loss_scale, lr=o.lr, betas=(o.beta1, o.beta2),
                   weight_decay=o.weight_decay, grad_clip=o.grad_clip, seed=t.seed,
                   batch_size=t.global_batch_size, seq_len=cfg.model.block_size,
                   fused=o.fused, compile=t.compile, all_to_all=p.all_to_all,
                   init_from=cfg.model.init_from.removeprefix("hf:"),
                   fp8_recipe=t.fp8_recipe, eos_id=eos_id)


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

    Raises ``ValueError`` (one line) for a layout that cannot run: a schedule that cannot be
    built, more chunks than layers, sizes tp does not divide, ZeRO-3 with a parameter shared
    by two chunks of one rank (tied at pp = 1 with chunks_per_rank > 1), PipeDream with a
    tied embedding across stages, cp > 1 with a sequence length 2 cp does not divide or a
    model whose description does not read positions through ``models.sequence``.
    """

    def __init__(self, model, topology, settings: EngineSettings,
                 device: torch.device | None = None):
        s = settings
        self.topology, self.s = topology, s
        self.device = device or torch.device("cpu")
        self.distributed = dist.is_available() and dist.is_initialized()
        groups = topology.groups if self.distributed else None
        p, v, kind = topology.pp, s.chunks_per_rank, s.schedule  # pp = 1: one stage
        local_batch = s.batch_size // topology.dp
        if local_batch % s.micro_batches:
            raise ValueError(f"{s.micro_batches} micro-batches do not divide the batch of "
                             f"{local_batch} sequences per data-parallel replica")
        if kind == "pipedream" and s.grad_clip > 0:
            raise ValueError("gradient clipping needs a flush; PipeDream has none")
        if kind == "pipedream" and p > 1 and describe(model).tied is not None:
            # the last stage steps (and would sum its copy's gradient) before the first
            # stage has run that micro-batch's backward: the stream deadlocks
            raise ValueError("PipeDream with tied embeddings across pipeline stages: each "
                             "stage steps on its own clock, so the two copies cannot be "
                             "summed per step; untie them or use a flush schedule")
        try:
            self.schedule = schedule(kind, p, s.micro_batches, v)
            self.stream = stream(p, s.micro_batches) if kind == "pipedream" else None
        except ScheduleError as exc:
            raise ValueError(str(exc)) from None
        self.dtype = DTYPES[s.precision]
        self.pp_rank = topology.pp_rank
        self.pp_ranks = topology.axis_ranks("pp")
        self.pp_group = groups.pp if groups is not None else None
        # the replicas of every parameter: dp x cp (cp splits tokens, not weights)
        self.grad_group = groups.dp_cp if groups is not None else None
        # HSDP: ZeRO shards over one replica's dp_shard x cp ranks, then averages across the
        # replicas (``comm.replicas``); with dp_replicate = 1 this is the dp_cp group
        self.shard_group = groups.dp_shard_cp if groups is not None else None
        self.cp = self._context_parallel(model)
        self.tp = (RankGroup.from_topology(topology, sequence_parallel=s.sequence_parallel)
                   if groups is not None and topology.tp > 1 else RankGroup())
        self.ep = (RankGroup.from_topology(topology, "ep")
                   if groups is not None and topology.ep > 1 else RankGroup(axis="ep"))
        # dropout: the same stream on the tp ranks of a replica (replicated regions), one per
        # dp replica and stage; tp-sharded regions add the tp rank (Megatron's RNG tracker)
        self.dropout_seed = s.seed + 1000 * (topology.dp_rank + 1) + 100 * topology.pp_rank
        self.local: LocalModel = build_local_model(
            model, pp=p, pp_rank=self.pp_rank, chunk_ids=self.schedule.chunks_of(self.pp_rank),
            n_chunks=p * v, tp=self.tp, seed=s.seed, dropout_seed=self.dropout_seed,
            device=self.device, partition_by=s.partition,
            time_sample=(s.batch_size // topology.dp // s.micro_batches, s.seq_len),
            average=self._average, ep=self.ep, all_to_all=s.all_to_all,
            init_from=s.init_from or None)
        self.description: ModelDescription = self.local.description
        self.block_causal = self.description.attention_mask == "block_causal"
        if self.block_causal and s.eos_id is None:
            raise ValueError(BLOCK_CAUSAL_NEEDS_EOS)
        torch.manual_seed(self.dropout_seed)
        self.fp8_layers: list[str] = self._float8() if s.precision == "fp8" else []
        if s.recompute == "selective":
            self._checkpoint_selectively()
        if s.compile:
            self._compile_blocks()
        self.loss_scaler = (DynamicLossScaler(s.initial_loss_scale)
                            if s.precision == "fp16" and s.loss_scaling else None)
        self.chunks: dict[int, nn.Module] = dict(self.local.chunks)
        self.sync = self._wrap_for_dp()
        tied_peer = None
        if self.local.tied and p > 1:
            other = p - 1 if self.local.has_first else 0
            tied_peer = topology.rank_of(topology.dp_rank, other, topology.tp_rank,
                                         cp=topology.cp_rank)
        self.optimizer = DistributedOptimizer(
            self.sync, tp=self.tp, sequence_parallel=s.sequence_parallel, lr=s.lr,
            betas=s.betas, weight_decay=s.weight_decay, loss_scaler=self.loss_scaler,
            tied_peer=tied_peer, tied_names=self.local.tied,
            tied_counted=self.local.has_first, global_norm=not self.schedule.weight_stashing,
            fused=self.device.type == "cuda" if s.fused is None else s.fused)
        seq = s.seq_len // topology.cp  # this rank's tokens of each sequence
        seq = seq // self.tp.size if self.tp.sequence_parallel else seq
        self.act_shape = (local_batch // s.micro_batches, seq, self.description.hidden_size)
        self.executor = Executor(
            self.schedule, self.pp_rank, self.chunks, self.pp_ranks, self.act_shape,
            loss_fn=self.local.loss_fn, on_step=self._optimizer_step, dtype=self.dtype,
            group=self.pp_group, recompute=s.recompute is True, grad_sync=self.sync,
            device=self.device, measure_memory=s.measure_memory,
            loss_scale=(lambda: self.loss_scaler.scale) if self.loss_scaler else (lambda: 1.0))
        self.stream_step = 0
        self.step = 0  # optimizer steps taken (restored on resume): seeds dropout per step
        self.last_step: dict = {"grad_norm": 0.0, "skipped": False}
        self.sync.zero_grad()

    # -- composition ----------------------------------------------------------------------
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
                for d in document_ids(idx, self.s.eos_id).chunk(m)]

    def _context_parallel(self, model) -> ContextParallel | None:
        """With cp > 1, this rank's ``ContextParallel`` (its ring of cp ranks); None else.
        Checks the sequence length and that the model reads positions through
        ``models.sequence`` (one-line ``ValueError``)."""
        topo, s = self.topology, self.s
        if topo.cp == 1:
            return None
        d = describe(model)
        if not d.context_parallel:
            raise ValueError(f"parallel.cp={topo.cp}: model {d.kind!r} does not say it reads "
                             "token positions from models.sequence.positions and attends "
                             "through models.gpt.causal_attention "
                             "(ModelDescription.context_parallel); use cp = 1")
        ring = Ring(self.topology.groups.cp if self.distributed else None,
                    tuple(topo.axis_ranks("cp")), topo.cp_rank)
        cp = ContextParallel(ring, self.device)
        cp.check(s.seq_len)
        if s.sequence_parallel and (s.seq_len // topo.cp) % topo.tp:
            raise ValueError(f"sequence length {s.seq_len} / cp={topo.cp} is not divisible by "
                             f"tp={topo.tp} (sequence parallelism splits each rank's tokens)")
        return cp

    def _checkpoint_selectively(self) -> None:
        """``parallel.recompute = "selective"``: every layer of this rank's chunks keeps its
        matmul and attention outputs and the outputs of the collectives in its forward, and
        recomputes the rest in backward (``parallel.activation_checkpoint``; the ring
        attention's shifts run again). Any layout: tp (with or without SP), cp, ep, ZeRO-3
        (its gathers are hooks outside the recomputed forward). Refused, until checked
        there, on CUDA."""
        if self.device.type == "cuda":
            raise ValueError(SELECTIVE_ON_CUDA)
        for chunk in self.local.chunks.values():
            for name, layer in zip(chunk.names, chunk.layers):
                checkpoint_selectively(layer, rng=self.local.rng, name=name)

    def _float8(self) -> list[str]:
        """``precision = "fp8"``: this rank's eligible ``nn.Linear`` swapped for torchao's
        ``Float8Linear`` (``parallel.float8``: same Parameters, bf16 around float8 matmuls),
        after tp sharding and before the dp sync and compile. Returns the converted module
        names. Raises ``ValueError`` (one line) without torchao, on a device without float8
        matmuls, or with tp > 1 (the config refuses these before any rank starts)."""
        from shardwise.parallel.float8 import check_fp8, convert_layers

        if self.tp.size > 1:
            raise ValueError(f"training.precision=fp8 with parallel.tp={self.tp.size}: not "
                             "supported (parallel.float8); use parallel.tp = 1")
        check_fp8(self.device.type, [torch.cuda.current_device() if self.device.index is None
                                     else self.device.index]
                  if self.device.type == "cuda" else None)
        named = [(n, layer) for c in sorted(self.local.chunks)
                 for n, layer in zip(self.local.chunks[c].names, self.local.chunks[c].layers)]
        return convert_layers(named, self.description.style_of, self.s.fp8_recipe,
                              high_precision=self.description.is_high_precision)

    def _compile_blocks(self) -> None:
        """``torch.compile`` every layer in place (``nn.Module.compile``: the embedding, each
        transformer block, the head) and the loss, so Inductor fuses the logits' cast into
        the cross-entropy instead of writing fp32 logits out. One graph per kind of layer:
        a pipeline chunk of any length reuses it. The collectives of tensor parallelism
        (``tensor_parallel.mappings``, the vocabulary-parallel loss) and of cp (ring
        attention, the ring's sums) are ``torch.compiler.disable``d, so a block compiles in
        pieces around them, which run eagerly. ZeRO-3's forward hooks, registered on these
        layers afterwards (``_wrap_for_dp``), are disabled too: each unit's gather and free
        run eagerly before and after its compiled block (``zero.stage3``)."""
        for chunk in self.local.chunks.values():
            for layer in chunk.layers:
                layer.compile()
        self.local.loss_fn = torch.compile(self.local.loss_fn)

    def _average(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed and dist.get_world_size() > 1:  # every rank must cut alike
            comm.all_reduce(t, op="mean")
        return t

    def _wrap_for_dp(self):
        """The gradient sync of ``parallel.zero`` over the dp x cp replicas (``engine.sync``;
        the dp group itself when cp = 1); under ep > 1 the expert parameters get their own,
        over their replicas, the ep_dp x cp group (``ep_dp_cp``; ep_dp when cp = 1), their
        sums divided by dp x cp as the dense ones: each expert's gradient already holds
        what every rank of its ep group routed to it."""
        named = self.local.named_parameters()
        experts = [(n, q) for n, q in named if is_expert(q)]
        topo = self.topology
        over = self._dense_sync_group()
        if not experts or not self.distributed:
            return self._sync_of(named, *over)
        if self.s.zero == 3:  # one wrapper, each unit's experts gathered over their replicas
            return self._sync_of(named, *over, expert_group=topo.groups.ep_dp_cp)
        dense = [(n, q) for n, q in named if not is_expert(q)]
        return SplitSync(self._sync_of(dense, *over),
                         self._sync_of(experts, topo.groups.ep_dp_cp, topo.ep_dp_cp,
                                       topo.ep_dp_cp_rank, divisor=topo.dp_cp))

    def _dense_sync_group(self) -> tuple:
        """``(group, size, rank, replicas)`` of the dense parameters' sync: ZeRO 1-3 under
        HSDP (dp_replicate > 1) shard over one replica (``dp_shard_cp``) and average across
        the replicas; otherwise the whole dp x cp group, no replicas (ZeRO-0 too: one
        all-reduce over every replica is already HSDP's mean, in one collective)."""
        topo = self.topology
        if self.s.zero == 0 or topo.dp_replicate == 1 or not self.distributed:
            return self.grad_group, topo.dp_cp, topo.dp_cp_rank, NO_REPLICAS
        replicas = Replicas(topo.groups.dp_replicate, topo.dp_replicate, topo.dp_replicate_rank)
        return self.shard_group, topo.dp_shard_cp, topo.dp_shard_cp_rank, replicas

    def _sync_of(self, named, group, size: int, rank: int, replicas: Replicas = NO_REPLICAS,
                 divisor: int | None = None, expert_group=None):
        """One gradient sync of ``parallel.zero`` for ``named`` over ``group`` (ZeRO-3 with
        ``expert_group``: the expert parameters of each unit sharded over that group)."""
        s = self.s
        whole = len(named) == len(self.local.named_parameters())
        names = {id(q): n for n, q in named}
        params = [q for _, q in named]
        tied = frozenset(id(q) for n, q in named if n in self.local.tied)  # across stages
        if s.zero == 0 or not self.distributed:
            return ReplicatedSync(params, names, group, size, rank, self.dtype, s.bucket_mb,
                                  s.first_bucket_mb, s.allreduce, divisor=divisor,
                                  replicas=replicas)
        if s.zero in (1, 2):
            container = nn.ModuleList(self.local.chunks[c] for c in sorted(self.local.chunks))
            return ZeroDataParallel(container, group, s.zero, s.bucket_mb, self.dtype,
                                    self.loss_scaler, names=names, isolate=tied, explicit=True,
                                    params=None if whole else params, divisor=divisor,
                                    replicas=replicas)
        # ZeRO-3: each chunk its own module (its layers the units, its own flat buffers), so
        # the interleaved schedule gathers and reduce-scatters a chunk around its own
        # micro-batches, independently of the rank's other chunks; joined as one sync
        shared = self.local.shared_across_chunks()
        if shared is not None:
            raise ValueError(zero3_shared_reason(s.chunks_per_rank, *shared))
        wrappers = []
        for c in sorted(self.local.chunks):
            chunk = self.local.chunks[c]
            self.chunks[c] = ZeroStage3(chunk, group, list(zip(chunk.names, chunk.layers)),
                                        self.dtype, self.loss_scaler, names, isolate=tied,
                                        expert_group=expert_group, replicas=replicas)
            wrappers.append(self.chunks[c])
        return SplitSync(*wrappers)

    @property
    def partition(self):
        """How the layers were cut into chunks (``pipeline.partition.Partition``)."""
        return self.local.partition

    def save_timeline(self, run_dir, title: str = "") -> None:
        """Write this rank's events of the last step to ``RUN_DIR/timeline/rank{r}.json``
        (draw them with ``shardwise timeline RUN_DIR``)."""
        s = self.s
        meta = {"title": title or f"{s.schedule} pp={self.topology.pp} m={s.micro_batches} "
                f"v={s.chunks_per_rank}", "pp_rank": self.pp_rank,
                "dp_rank": self.topology.dp_rank}
        timeline.save(run_dir, self.topology.rank,
                      timeline.from_executor(self.executor, self.topology.rank), meta)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their full model names (tp-local shapes)."""
        return self.local.named_parameters()

    def full_parameters(self):
        """A context in which every local parameter is materialised (ZeRO-3 gathers them;
        collective over dp x cp)."""
        return getattr(self.sync, "full_parameters", contextlib.nullcontext)()

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
        AdamW's two fp32 moments: measured once they exist, 8 bytes per master element
        before the first step), each storage counted once."""
        seen: set = set()
        params = [q for _, q in self.named_parameters()]
        out = {"params": sum(storage_bytes_once(seen, q) for q in params)}
        out["params"] += sum(storage_bytes_once(seen, t) for t in self.sync.param_shards())
        # ZeRO-1's shards are views into its buckets: a storage is counted once, whole
        grads = [q.grad for q in params] + list(self.sync.grad_shards())
        out["grads"] = sum(storage_bytes_once(seen, g) for g in grads)
        for part in getattr(self.sync, "parts", (self.sync,)):  # no buckets: none yet
            if isinstance(part, ReplicatedSync) and part.sync is None:
                out["grads"] += sum(q.numel() * q.element_size() for q in part.params
                                    if q.grad is None and q.requires_grad)
        opt = sum(storage_bytes_once(seen, m) for m in self.sync.pieces)
        state = self.optimizer.optimizer.state
        for m in self.sync.pieces:
            if m in state:
                opt += sum(storage_bytes_once(seen, state[m].get(k))
                           for k in ("exp_avg", "exp_avg_sq"))
            else:
                opt += 8 * m.numel()
        out["optimizer"] = opt
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        return out

    # -- training -------------------------------------------------------------------------
    def _optimizer_step(self) -> None:
        self.sync.finish()
        self.last_step = self.optimizer.step(self.s.grad_clip)
        self.sync.zero_grad()

    def train_step(self, idx: torch.Tensor, targets: torch.Tensor, sync: bool = True) -> dict:
        """One optimizer step on this dp replica's batch ``idx``, ``targets`` (B, T) int64
        (whole sequences: with cp > 1 each rank keeps its chunks of them; under
        ``block_causal`` every stage reads ``idx`` for its document ids, so every rank of
        the replica must be given the same tokens).
        Returns ``{"loss", "grad_norm", "skipped"}`` (and, with ZeRO-0 buckets,
        ``buckets_overlapped``: [launched before the schedule's end, buckets]); the loss is the
        mean over micro-batches, cp shards and dp replicas, the same on every rank. ``sync=True``: loss
        and norm as Python floats (the host waits for the device); ``sync=False``: as 0-d
        tensors on the device, so a loop can run ahead and read them at its logging interval
        (``settle`` converts such a dict)."""
        m = self.schedule.m
        self._seed_step()
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
        self.step += 1
        router = self._router_stats(m)
        if router:  # auxiliary-loss-free balancing: the step's global load moves the biases
            for i, layer in self.local.moe_local:
                update = getattr(layer, "update_bias", None)
                if callable(update):
                    update(router["expert_load"][i])
        info = {"loss": self._share_loss(total), **self.last_step, **router}
        buckets = getattr(self.sync, "sync", None)
        if buckets is not None:  # our DDP's buckets: how many started before backward ended
            info["buckets_overlapped"] = [buckets.launched_early, len(buckets.buckets)]
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
        torch.manual_seed(base)

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
            last = self.pp_ranks[(self.local.n_chunks - 1) % self.topology.pp]
            comm.broadcast(t, src=last, group=self.pp_group, check=False,  # fixed shape
                           algorithm="auto")
        if self.topology.dp_cp > 1:
            comm.all_reduce(t, op="mean", group=self.grad_group, check=False)
        return t[0]

    # -- forward only: evaluation and generation ------------------------------------------
    @torch.no_grad()
    def _logits(self, idx: torch.Tensor, shard: SequenceShard | None = None
                ) -> torch.Tensor | None:
        """Forward of ``idx`` (B, T) through the stages in order (one micro-batch in flight,
        blocking p2p between stages), inside ``models.sequence.use(shard)`` when a shard is
        given (None: whole sequences, plain causal). Returns this tp rank's logits (B, T,
        V_pad / tp) on the last stage, None elsewhere. Every rank of the replica must call
        it."""
        with sequence.use(shard) if shard is not None else contextlib.nullcontext():
            return self._stages(idx)

    def _stages(self, idx: torch.Tensor) -> torch.Tensor | None:
        p, me, n = self.topology.pp, self.pp_rank, self.local.n_chunks
        B, T = idx.shape
        seq = T // self.tp.size if self.tp.sequence_parallel else T
        x = None
        for c in range(n):
            if c % p != me:
                continue
            if c == 0:
                x = idx
            elif (c - 1) % p != me:
                x = torch.empty(B, seq, self.description.hidden_size, dtype=self.dtype, device=self.device)
                comm.recv(x, src=self.pp_ranks[(c - 1) % p], group=self.pp_group)
            x = self.chunks[c](x)
            if c < n - 1 and (c + 1) % p != me:
                comm.send(x.contiguous(), dst=self.pp_ranks[(c + 1) % p], group=self.pp_group)
        return x if self.local.has_last else None

    @torch.no_grad()
    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean cross-entropy (nats per token) of one batch (B, T) of whole sequences, on every
        rank of the replica (with cp > 1 each rank evaluates its chunks, then the cp ranks
        average)."""
        self._train(False)
        whole = idx
        if self.cp is not None:
            idx, targets = self.cp.shard(idx, targets)
        shards = self._sequence_shards(whole, 1)
        logits = self._logits(idx, shards[0] if shards else None)
        value = float(self.local.loss_fn(logits, targets)) if logits is not None else 0.0
        self._train(True)
        if self.distributed and self.topology.pp > 1:
            t = torch.tensor([value], dtype=torch.float64, device=self.device)
            last = self.pp_ranks[(self.local.n_chunks - 1) % self.topology.pp]
            comm.broadcast(t, src=last, group=self.pp_group, algorithm="auto")
            value = float(t)
        if self.cp is not None and self.distributed:
            t = torch.tensor([value], dtype=torch.float64, device=self.device)
            comm.all_reduce(t, op="mean", group=self.topology.groups.cp, check=False)
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
        last = self.pp_ranks[(self.local.n_chunks - 1) % self.topology.pp]

        def logits_of(ctx):  # (B, T, V) on the last stage, gathered over tp; None elsewhere
            logits = self._logits(ctx)
            if logits is None:
                return None
            return gather_tensor(logits, -1, self.tp)[..., :vocab]

        share = None
        if self.distributed and self.topology.pp > 1:
            share = lambda nxt: comm.broadcast(nxt, src=last, group=self.pp_group,
                                               algorithm="auto")
        self._train(False)
        idx = generate(logits_of, idx, new_tokens, self.description.block_size,
                       pad_to=self.tp.size if self.tp.sequence_parallel else 1,
                       share=share, generator=generator, **sampling)
        self._train(True)
        return idx

    def _train(self, mode: bool) -> None:
        for chunk in self.chunks.values():
            chunk.train(mode)
