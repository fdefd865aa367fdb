"""The language model's trainer: a decoder (any ``model.kind``) on a text, in any layout.

``Trainer(cfg, topology, device)`` builds the data (``apps.lm.text``) and one
``engine.Engine`` for this rank (whatever the layout: the engine composes dp, tp, pp, ZeRO
and precision); ``fit()`` runs the shared loop (``training.loop.run_loop``) over it. It also
runs without ``torch.distributed`` (one process, dp=1), which is how parity tests build their
single-process reference.

Resume state is explicit: ``state_dict()`` returns ``(tensors, meta)`` — tensors go to
DCP, meta (JSON) beside them — and ``load_state_dict`` restores both (``apps.lm.state``).

With ``fault_tolerance.enable`` this job is one replica group of a torchft job
(``training.fault_tolerance``, docs/reliability.md): each step starts with the quorum (a
replica group that is behind heals there, each rank from a rank of the same coordinates in
a live group: its ``state_dict(joined=False)``, sent over the replica process group), the
engine averages the gradients across the live replica
groups and steps only where they all voted to commit; a step that does not commit is redone
on the same samples. Replica group ``r`` of ``n`` reads slot ``r`` of each global batch
(``training.global_batch_size`` is the whole job's).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.apps.lm.hf import resolve_init_from, source_config
from shardwise.apps.lm.model import describe_layout
from shardwise.apps.lm.state import TrainerState
from shardwise.apps.lm.text import loss_masks, split_corpus, token_unit
from shardwise.base.config import Config
from shardwise.base.files import write_text
from shardwise.base.topology import Topology, init_process_groups
from shardwise.comm.replicas import NO_REPLICAS
from shardwise.data import CharTokenizer, DistributedBatchSampler, HFTokenizer
from shardwise.data.corpus import DataError
from shardwise.data.sampler import IGNORE_INDEX
from shardwise.engine import Engine, EngineConfig
from shardwise.engine import state as engine_state
from shardwise.launch import rank_device
from shardwise.models import describe_section
from shardwise.training.console import status
from shardwise.training.fault_tolerance import FaultTolerantReplica
from shardwise.training.loop import Cadence, TrainTask, run_loop
from shardwise.training.metrics import plot_loss
from shardwise.training.schedule import warmup_cosine


class Trainer(TrainerState, TrainTask):
    """One rank's view of a training run in any layout (see module docstring)."""

    def __init__(self, cfg: Config, topology: Topology, device: torch.device | None = None,
                 tokenizer: CharTokenizer | HFTokenizer | None = None):
        cfg = resolve_init_from(cfg)  # model.init_from: the sizes of its config.json
        self.hf_config = source_config(cfg)  # kept in checkpoints, for `shardwise export`
        self.cfg, self.topology = cfg, topology
        self.device = device or torch.device("cpu")
        if self.device.type == "cuda":  # TF32 for fp32 matmuls (training.tf32); CPU: no effect
            torch.set_float32_matmul_precision("high" if cfg.training.tf32 else "highest")
        self.distributed = dist.is_initialized()
        self.is_main = topology.rank == 0
        self.tokenizer, self.train_tokens, self.val_tokens = split_corpus(cfg, tokenizer)
        o, t = cfg.optimizer, cfg.training
        # the [model] section's kind (gpt, llama, a registered one) as the engine reads it
        self.description = describe_section(cfg.model, self.tokenizer.vocab_size)
        self.model_cfg = self.description.config
        # split, then parallelize: pipeline chunks, tp shards, dp sync, one optimizer
        # the tokenizer's end-of-text id ends documents under model.attention_mask =
        # "block_causal" (the character tokenizer has none: the engine refuses it then)
        view = EngineConfig.of(cfg, eos_id=getattr(self.tokenizer, "eos_id", None))
        ft = cfg.fault_tolerance
        self.ft = self._join_replica_groups() if ft.enable else None
        groups, slot = (ft.group_size, ft.replica_id) if self.ft is not None else (1, 0)
        if groups > 1:  # the engine trains this replica group's slot of the global batch
            view = replace(view, training=t.model_copy(
                update={"global_batch_size": t.global_batch_size // groups}))
        self.engine = Engine(self.description, topology, view, self.device,
                             replicas=self.ft.replicas if self.ft is not None else NO_REPLICAS)
        self.optimizer = self.engine.optimizer
        self.scheduler = warmup_cosine(self.optimizer.optimizer, o, t.steps)
        # replica group r's dp rank d reads part r x dp + d of the global batch's n x dp
        # chat data: only the assistant's tokens are targets, in training and validation
        mask, self.val_mask = loss_masks(cfg)
        if mask is not None and groups > 1:
            raise DataError("data.path: a loss mask (chat data) with fault_tolerance is not "
                            "supported yet")
        self.sampler = DistributedBatchSampler(self.train_tokens, cfg.model.block_size,
                                               t.global_batch_size,
                                               slot * topology.dp + topology.dp_rank,
                                               groups * topology.dp, seed=t.seed, mask=mask)
        self.step = 0
        self.out_dir = Path(t.out_dir)
        self.history: list[float] = []
        self._pending: list[torch.Tensor] = []  # losses of steps not yet read on the host
        self._pin = self.device.type == "cuda"  # page-locked batches, copied asynchronously
        # what the loop needs: cadence, work per step (tokens), FLOPs per token, peak dtype
        self.cadence = Cadence.from_config(cfg)
        self.sample_unit = "tokens"
        self.samples_per_step = t.global_batch_size // groups * cfg.model.block_size
        self.flops_per_sample = self.engine.local.flops_per_token
        self.world_size = topology.world_size
        self.memory_group = None if self.distributed else "local"  # every rank runs the loop
        self.dtype = self.engine.dtype

    # -- fault tolerance ------------------------------------------------------------------
    def _join_replica_groups(self) -> FaultTolerantReplica:
        """This rank's torchft Manager: its store served by the group's rank 0 on the
        rendezvous host (``MASTER_ADDR``: 127.0.0.1 for a local run), which is also the
        address the other replica groups reach and the one the Manager's server binds."""
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.topology.rank == 0:  # kept alive with the trainer
            self._ft_store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port[0] = self._ft_store.port
        if self.distributed and self.topology.world_size > 1:
            comm.broadcast(port, src=0, check=False)
        main = self.topology.rank == 0  # one line per replica group, not per rank
        return FaultTolerantReplica(
            self.cfg.fault_tolerance, state_dict=self._heal_state,
            load_state_dict=self._heal_from, device=self.device, store_addr=host,
            store_port=int(port.item()), hostname=host, group_rank=self.topology.rank,
            group_world_size=self.topology.world_size, bind=host,
            log=(lambda line: status(f"shardwise: {line}", file=sys.stderr))  # above the bar
            if main else (lambda line: None))

    def _heal_state(self) -> dict:
        """What the rank of the same coordinates in a healing replica group copies (torchft
        calls it at the quorum, on the ranks it picked as sources: not every rank of a
        group, so no communication here): this rank's ``state_dict(joined=False)``, each
        ``DTensor`` as its local slice."""
        self.settle()
        tensors, meta = self.state_dict(joined=False)
        return {"tensors": engine_state.local_slices(tensors), "meta": meta}

    def _heal_from(self, state: dict) -> None:
        """Load a live peer's ``_heal_state`` (no communication)."""
        tensors = state["tensors"]
        if self.engine.tp.size > 1 or self.engine.ep.size > 1:  # back into DTensors
            like = engine_state.logical_tensors(self.engine, targets=True, joined=False)
            tensors = engine_state.as_logical(tensors, like)
        self._pending = []  # losses of steps the peer's history replaces
        self.load_state_dict(tensors, state["meta"])

    def join_next_step(self) -> None:
        """Join the next step's quorum now, before this step's checkpoint or validation (the
        loop calls it when steps are left). Why: a replica group writing a checkpoint between
        two steps keeps heartbeating, and torchft's lighthouse waits for a heartbeating group
        that has not asked only ``join_timeout_ms`` before forming the quorum without it;
        that group then heals from a peer when it asks, and its slot of the steps in between
        is never trained (docs/reliability.md, the soak). Joined first, it is in the quorum,
        and the peers wait for it inside the step, at the gradient average, up to
        ``process_group_timeout_ms``. Every group pauses at the same steps
        (``checkpoint.every``, ``training.eval_every``), so each waits only for the slowest."""
        if self.ft is not None:
            self.ft.start_step()

    # -- one step -------------------------------------------------------------------------
    def train_step(self, sync: bool = True) -> dict | None:
        """One optimizer step on this rank's share of the next global batch. ``sync=False``:
        the loss and norm stay 0-d tensors on the device (``settle`` reads them), so the host
        runs ahead of the GPU; ``self.history`` gets them at the next ``settle``. With fault
        tolerance: None when the step did not commit (the sampler is back where it was: the
        step is redone on the same samples)."""
        if self.ft is not None:
            # the quorum (joined already where the loop paused after the last step); behind:
            # healed here (step, sampler, weights)
            self.ft.start_step()
            position = self.sampler.state_dict()
        x, y = self.sampler.next_batch()
        if self._pin:
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        info = self.engine.train_step(x, y, sync=False, n_targets=self.sampler.global_targets)
        if not self.engine.committed:
            self.sampler.load_state_dict(position)
            return None
        self.scheduler.step()
        self.step += 1
        self._pending.append(info["loss"])
        info = {**info, "lr": self.optimizer.param_groups[0]["lr"]}
        if self.ft is not None:  # slots of the global batch trained so far, every group's
            info["batches_committed"] = self.ft.batches_committed
        if self.engine.loss_scaler is None:
            info.pop("skipped")
        else:
            info["loss_scale"] = self.engine.loss_scaler.scale
        return self.settle(info) if sync else info

    def _mean_over_dp(self, value: float) -> float:
        if not self.distributed or self.topology.dp == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        comm.all_reduce(t, op="mean", group=self.topology.groups.dp, check=False)  # fixed shape
        return float(t)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """``{"val_loss": mean validation loss (nats per token: per char with the character
        tokenizer)}`` over a fixed set of held-out windows (collective over dp); with a loss
        mask (chat data) the mean over those windows' target tokens, as training's."""
        t, m = self.cfg.training, self.cfg.model
        local = max(1, t.global_batch_size // self.topology.dp)
        n_windows = (len(self.val_tokens) - 1) // m.block_size
        total = min(n_windows, t.eval_batches * local * self.topology.dp)
        per_rank = max(1, total // self.topology.dp)
        start = self.topology.dp_rank * per_rank
        idx = torch.arange(start, min(start + per_rank, n_windows))
        starts = idx * m.block_size
        offs = torch.arange(m.block_size + 1)
        pos = starts[:, None] + offs[None, :]
        w = self.val_tokens[pos].to(self.device)
        if self.val_mask is not None:
            return {"val_loss": self._masked_val_loss(w, pos, local)}
        losses = [self.engine.loss(xb, yb)
                  for xb, yb in zip(w[:, :-1].split(local), w[:, 1:].split(local))]
        return {"val_loss": self._mean_over_dp(sum(losses) / len(losses))}

    def _masked_val_loss(self, w: torch.Tensor, pos: torch.Tensor, local: int) -> float:
        """The summed nats over the target tokens of windows ``w`` (K, T + 1) at positions
        ``pos`` of the val split, over every dp rank's windows, divided by their count."""
        y = w[:, 1:].clone()
        y[self.val_mask[pos[:, 1:]].to(self.device) == 0] = IGNORE_INDEX
        sums = [self.engine.loss_sum(xb, yb) for xb, yb in zip(w[:, :-1].split(local),
                                                                 y.split(local))]
        t = torch.tensor([sum(s for s, _ in sums), sum(n for _, n in sums)],
                         dtype=torch.float64, device=self.device)
        if self.distributed and self.topology.dp > 1:
            comm.all_reduce(t, op="sum", group=self.topology.groups.dp, check=False)
        return float(t[0] / t[1]) if t[1] else float("nan")

    def eval_line(self, row: dict) -> str:
        """The progress line of a validation row, in nats per token (or per character)."""
        return (f"step {row['step']}: validation loss {row['val_loss']:.4f} "
                f"nats/{token_unit(self.tokenizer)}")

    # -- the loop -------------------------------------------------------------------------
    def fit(self, progress: bool | None = None) -> dict:
        """Train until ``training.steps`` (``run_loop``); returns ``step``, the final train
        ``loss``, ``val_loss`` and ``elapsed_s``."""
        return run_loop(self, progress)

    def end_of_training(self) -> None:
        """After the last step: save the pipeline's timeline (pp > 1, for ``shardwise timeline``)
        and drain PipeDream's last backwards."""
        if self.topology.pp > 1 and self.topology.dp_rank == 0:  # for `shardwise timeline`
            self._save_timeline()
        self.engine.drain()  # PipeDream: the last micro-batches' backwards

    def finish(self) -> None:
        """Rank 0: loss-curve PNG and a generated sample, printed. Call on every rank:
        generation is collective over dp replica 0's tp and pp groups (and ep group)."""
        # generation runs on dp replica 0, and under expert parallelism on its ep group too
        # (the experts' all-to-all needs every rank of it; they sample the same tokens)
        samplers = self.topology.ep_dp_rank == 0
        with self.engine.full_parameters():  # ZeRO-3: gathered once (collective over dp)
            if self.is_main:
                self._write_outputs()
            elif samplers and self.cfg.training.sample_chars:
                self._sample()

    def _save_timeline(self) -> None:
        p = self.cfg.parallel
        self.engine.save_timeline(self.out_dir, f"{p.schedule}, pp={self.topology.pp}, "
                                  f"m={p.micro_batches}, last training step")

    def draw(self) -> Path | None:
        """Rank 0: (re)draw ``loss.png`` from ``metrics.jsonl``, in nats per token (per
        character with the character tokenizer); None before the first row."""
        if not (self.out_dir / "metrics.jsonl").is_file():
            return None
        data = self.cfg.data.path or "Shakespeare"
        return plot_loss(self.out_dir / "metrics.jsonl", self.out_dir / "loss.png",
                         title=f"{self.description.kind} on {data}, {describe_layout(self.cfg)}",
                         unit=token_unit(self.tokenizer))

    def _write_outputs(self) -> None:
        png = self.draw()
        print(f"loss curve: {png}")
        if self.cfg.training.sample_chars:
            text = self._sample()
            write_text(self.out_dir / "sample.txt", text)
            print("sample:\n" + text)

    def _sample(self) -> str:
        g = torch.Generator(device=self.device).manual_seed(self.cfg.training.seed)
        prompt = torch.tensor([self.tokenizer.start_ids()], device=self.device)  # (1, P)
        # a checkpoint's vocabulary may be larger than the tokenizer's: sample from the latter
        out = self.engine.generate(prompt, self.cfg.training.sample_chars, generator=g,
                                   vocab_size=self.tokenizer.vocab_size)
        return self.tokenizer.decode(out[0].tolist())


def build_trainer(cfg: Config) -> Trainer:
    """A ``Trainer`` for ``cfg`` on this rank: the rank grid of ``cfg.parallel`` over the
    initialised process group (its groups created, collectively), or one process without
    ``torch.distributed``."""
    p = cfg.parallel
    if dist.is_initialized():
        topo = init_process_groups(Topology.build(p.dp, p.pp, p.tp, cp=p.cp,
                                                  rank=dist.get_rank(),
                                                  world_size=dist.get_world_size(), ep=p.ep,
                                                  dp_replicate=p.dp_replicate))
    else:
        topo = Topology.build(p.dp, p.pp, p.tp, cp=p.cp, ep=p.ep,
                              dp_replicate=p.dp_replicate)
    return Trainer(cfg, topo, rank_device(cfg.training.device))
