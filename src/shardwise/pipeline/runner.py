"""Train a shardwise GPT with pipeline (x data) parallelism: the piece a trainer calls.

Every rank builds the same full GPT (same seed), cuts it into ``pp * v`` chunks, keeps its
own, and each ``train_step`` runs the schedule on the global batch split into ``m``
micro-batches in order. Loss per micro-batch is computed on the last stage and divided by
``m``; the mean is shared with every rank. With ``dp > 1`` each dp replica gets its slice of
the batch (as the data sampler gives it) and the gradients are averaged over the dp group
in buckets (``data_parallel.GradientSync``: each bucket's all-reduce starts when the last
backward of its chunk has run) before the optimizer step, which happens once per step
(flush schedules) or after every backward (PipeDream).

PipeDream never flushes: ``train_step`` k runs segment k of one endless 1F1B stream
(``pipeline.stream``), so micro-batches of one step are still in flight when the next step
starts; ``drain()`` finishes them (the trainer calls it before a checkpoint and at the end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn as nn

from shardwise import comm
from shardwise.data_parallel.grad_sync import GradientSync
from shardwise.pipeline.executor import Executor
from shardwise.pipeline.partition import Partition, gpt_layers, partition_layers, profile_layers, balanced
from shardwise.pipeline.schedules import ScheduleError, schedule
from shardwise.pipeline.stage import gpt_chunks, lm_loss
from shardwise.pipeline.stream import stream


@dataclass(frozen=True)
class PipelineConfig:
    """``schedule``: naive | gpipe | 1f1b | interleaved | pipedream. ``microbatches``: m per
    step (must divide the per-replica batch). ``chunks_per_rank``: v (interleaved).
    ``partition``: weigh layers by ``layers`` | ``params`` | ``time``. ``recompute``:
    checkpoint each chunk's forward. ``clip``: global gradient-norm clip (None: off).
    ``measure_memory``: meter saved-for-backward bytes (``executor.meter.peak``; costs time).
    ``bucket_mb``, ``first_bucket_mb``, ``allreduce``: the dp gradient buckets (MiB) and
    all-reduce algorithm, as for our DDP (used when dp > 1)."""

    schedule: str = "1f1b"
    microbatches: int = 1
    chunks_per_rank: int = 1
    partition: str = "layers"
    recompute: bool = False
    clip: float | None = None
    measure_memory: bool = False
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    allreduce: str = "auto"


class PipelineRunner:
    """One rank's share of a pipelined GPT. ``make_optimizer(named_params)`` builds the
    optimizer over this rank's parameters (a list of ``(GPT name, parameter)``).

    Raises ``ValueError`` (one line) for a bad layout: more chunks than layers, a batch that
    ``m`` does not divide, tied embeddings with ``pp > 1``, interleaving with ``m % pp``.
    """

    def __init__(self, model: nn.Module, topology, cfg: PipelineConfig, batch_size: int,
                 seq_len: int,
                 make_optimizer: Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]):
        p, v, m = topology.pp, cfg.chunks_per_rank, cfg.microbatches
        if batch_size % m:
            raise ValueError(f"{m} micro-batches do not divide the batch of {batch_size} "
                             f"sequences per data-parallel replica")
        if cfg.clip is not None and cfg.schedule == "pipedream":
            raise ValueError("gradient clipping needs a flush; PipeDream has none")
        try:
            self.schedule = schedule(cfg.schedule, p, m, v)
            self.stream = stream(p, m) if cfg.schedule == "pipedream" else None
        except ScheduleError as exc:
            raise ValueError(str(exc)) from None
        self.cfg, self.topology = cfg, topology
        self.stream_step = 0  # PipeDream: steps run since the stream (re)started
        self.groups = topology.groups
        self.pp_rank, self.pp_ranks = topology.pp_rank, topology.axis_ranks("pp")
        self.partition = self._partition(model, p * v, batch_size // m, seq_len)
        self.chunks = gpt_chunks(model, self.partition, self.schedule.chunks_of(self.pp_rank))
        self.named = [np for c in self.chunks.values() for np in c.model_parameters()]
        self.optimizer = make_optimizer(self.named)
        self.grad_sync = None
        if topology.dp > 1:  # buckets all-reduced over dp as each becomes final
            self.grad_sync = GradientSync([q for _, q in self.named], self.groups.dp,
                                          cfg.bucket_mb, cfg.first_bucket_mb, cfg.allreduce)
        act_shape = (batch_size // m, seq_len, model.cfg.n_embd)
        self.executor = Executor(self.schedule, self.pp_rank, self.chunks, self.pp_ranks,
                                 act_shape, loss_fn=lm_loss, on_step=self._optimizer_step,
                                 group=None if self.groups is None else self.groups.pp,
                                 recompute=cfg.recompute, measure_memory=cfg.measure_memory,
                                 grad_sync=self.grad_sync)

    def _partition(self, model: nn.Module, parts: int, mb_size: int, seq_len: int) -> Partition:
        layers = [m for _, m in gpt_layers(model)]
        if parts > len(layers):
            raise ValueError(f"cannot cut {len(layers)} layers (embedding, {len(layers) - 2} "
                             f"blocks, head) into {parts} pipeline chunks")
        if self.cfg.partition != "time":
            return partition_layers(layers, parts, by=self.cfg.partition)
        sample = torch.zeros(mb_size, seq_len, dtype=torch.long)
        secs = torch.tensor(profile_layers(layers, sample).seconds, dtype=torch.float64)
        if self.topology.world_size > 1:  # every rank must cut the same way: average timings
            comm.all_reduce(secs, op="mean")
        return balanced(secs.tolist(), parts)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the full GPT."""
        return list(self.named)

    def _grads(self) -> Iterable[torch.Tensor]:
        return (p.grad for _, p in self.named if p.grad is not None)

    def _optimizer_step(self) -> None:
        if self.grad_sync is not None:  # wait for the buckets (PipeDream: all-reduce now)
            self.grad_sync.finish()
        if self.cfg.clip is not None:
            sq = torch.zeros(1, dtype=torch.float64)
            for g in self._grads():
                sq += g.double().pow(2).sum()
            if self.topology.pp > 1:
                comm.all_reduce(sq, group=self.groups.pp)
            scale = self.cfg.clip / (math.sqrt(float(sq)) + 1e-6)
            if scale < 1:
                for g in self._grads():
                    g.mul_(scale)
        self.optimizer.step()
        if self.grad_sync is not None:
            self.grad_sync.zero_grad()  # in place: gradients stay views into the buckets
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, idx: torch.Tensor | None, targets: torch.Tensor | None) -> float:
        """One step on this replica's batch: ``idx``, ``targets`` (B, T) int64 (only the
        first stage reads ``idx``, only the last ``targets``; others may pass ``None``).
        Returns the mean loss over micro-batches (and dp replicas), on every rank."""
        m = self.schedule.m
        inputs = None if idx is None else list(idx.chunk(m))
        tgts = None if targets is None else list(targets.chunk(m))
        if self.stream is None:
            losses = self.executor.run(inputs, tgts)
        else:  # no flush: this step's segment of the stream; some micro-batches stay in flight
            k = self.stream_step
            losses = self.executor.run(inputs, tgts, self.stream.segment(k)[self.pp_rank],
                                       first_mb=k * m)
            self.stream_step += 1
        loss = torch.tensor([sum(losses) / m if losses else 0.0], dtype=torch.float64)
        if self.topology.pp > 1:
            comm.broadcast(loss, src=self.pp_ranks[-1], group=self.groups.pp)
        if self.topology.dp > 1:
            comm.all_reduce(loss, op="mean", group=self.groups.dp)
        return float(loss)

    def drain(self) -> None:
        """PipeDream: run the backwards (and weight updates) of the micro-batches still in
        flight, leaving an empty pipeline; the next ``train_step`` starts a new stream. Call
        on every rank of the pipeline (it communicates). Nothing to do for flush schedules."""
        if self.stream is None or self.stream_step == 0:
            return
        ops = self.stream.drain(self.stream_step - 1)[self.pp_rank]
        self.executor.run(None, None, ops)
        self.stream_step = 0
        assert self.executor.in_flight == 0 and not self.executor.ready

    def save_timeline(self, run_dir, title: str = "") -> None:
        """Write this rank's events of the last step to ``RUN_DIR/timeline/rank{r}.json``
        (draw them with ``shardwise timeline RUN_DIR``)."""
        from shardwise.pipeline import timeline

        meta = {"title": title or f"{self.cfg.schedule} pp={self.topology.pp} "
                f"m={self.cfg.microbatches} v={self.cfg.chunks_per_rank}",
                "pp_rank": self.pp_rank, "dp_rank": self.topology.dp_rank}
        timeline.save(run_dir, self.topology.rank,
                      timeline.from_executor(self.executor, self.topology.rank), meta)
