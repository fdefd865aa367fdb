"""The training loop: AdamW, warm-up + cosine LR, clipping, validation, checkpoints.

``Trainer(cfg, topology, device)`` builds data, model, DDP and optimizer for one rank;
``fit()`` runs the loop. It also runs without ``torch.distributed`` (one process, dp=1),
which is how parity tests build their single-process reference.

Resume state is explicit: ``state_dict()`` returns ``(tensors, meta)`` — tensors go to
DCP, meta (JSON) beside them — and ``load_state_dict`` restores both.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise import tensor_parallel as tp
from shardwise.config import Config
from shardwise.data import CharTokenizer, DistributedBatchSampler, load_text
from shardwise.data_parallel import DistributedDataParallel
from shardwise.errors import NonFiniteLossError
from shardwise.metrics import MetricsLog, plot_loss
from shardwise.models import GPT, GPTConfig
from shardwise.pipeline.inference import pipeline_generate, pipeline_loss
from shardwise.pipeline.runner import PipelineConfig, PipelineRunner
from shardwise.tensor_parallel import TPGroup
from shardwise.topology import Topology
from shardwise.trainer_state import TrainerState
from shardwise.zero import ZeroDataParallel, ZeroStage3
from shardwise.zero.precision import DTYPES, DynamicLossScaler


def lr_lambda(step: int, warmup: int, total: int, lr: float, min_lr: float) -> float:
    """Multiplier of ``lr`` at ``step``: linear warm-up, then cosine down to ``min_lr``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return (min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))) / lr


class Trainer(TrainerState):
    """One rank's view of a data-parallel training run (see module docstring)."""

    def __init__(self, cfg: Config, topology: Topology, device: torch.device | None = None,
                 tokenizer: CharTokenizer | None = None):
        self.cfg, self.topology = cfg, topology
        self.device = device or torch.device("cpu")
        self.distributed = dist.is_initialized()
        self.is_main = topology.rank == 0
        text = load_text(cfg.data.path)
        self.tokenizer = tokenizer or CharTokenizer.from_text(text)
        tokens = self.tokenizer.encode(text)
        n_val = max(cfg.model.block_size + 1, int(len(tokens) * cfg.data.val_fraction))
        self.train_tokens, self.val_tokens = tokens[:-n_val], tokens[-n_val:]

        m = cfg.model
        torch.manual_seed(cfg.training.seed)
        self.gpt_cfg = GPTConfig(vocab_size=m.vocab_size or self.tokenizer.vocab_size,
                                 block_size=m.block_size, n_layer=m.n_layer, n_head=m.n_head,
                                 n_embd=m.n_embd, dropout=m.dropout, bias=m.bias,
                                 tie_weights=m.tie_weights)
        self.tp = (TPGroup.from_topology(topology, sequence_parallel=cfg.parallel.sequence_parallel)
                   if self.distributed and topology.tp > 1 else None)
        if self.tp is not None:  # the full GPT from the same seed, then this rank's slices
            self.model = tp.build_tp_gpt(self.gpt_cfg, self.tp, cfg.training.seed).to(self.device)
        else:
            self.model = GPT(self.gpt_cfg).to(self.device)
        p, o, t = cfg.parallel, cfg.optimizer, cfg.training
        self.ddp = self.zero = self.pipeline = None
        self.loss_scaler = (DynamicLossScaler(t.initial_loss_scale)
                            if t.precision == "fp16" and t.loss_scaling else None)
        mp = {"param_dtype": DTYPES[t.precision], "loss_scaler": self.loss_scaler}
        if self.distributed and p.zero == 3:
            self.zero = ZeroStage3(self.model, topology.groups.dp, **mp)
        elif self.distributed and p.zero > 0:
            self.zero = ZeroDataParallel(self.model, topology.groups.dp, p.zero, p.bucket_mb, **mp)
        elif self.distributed and topology.pp > 1:  # the runner builds AdamW over its stages
            self.pipeline = PipelineRunner(
                self.model, topology,
                PipelineConfig(schedule=p.schedule, microbatches=p.micro_batches,
                               chunks_per_rank=p.chunks_per_rank, partition=p.partition,
                               recompute=p.recompute, clip=o.grad_clip or None,
                               bucket_mb=p.bucket_mb, first_bucket_mb=p.first_bucket_mb,
                               allreduce=p.allreduce),
                batch_size=t.global_batch_size // topology.dp, seq_len=m.block_size,
                make_optimizer=lambda named: self._adamw([q for _, q in named]))
        elif self.distributed and topology.dp > 1:
            self.ddp = DistributedDataParallel(self.model, topology.groups.dp, p.bucket_mb,
                                               p.allreduce,
                                               first_bucket_mb=p.first_bucket_mb)
        # dropout streams differ per rank; the model init above is identical everywhere
        torch.manual_seed(cfg.training.seed + 1000 * (topology.rank + 1))

        if self.pipeline is not None:
            self.optimizer = self.pipeline.optimizer
        elif self.zero is not None:  # AdamW over this rank's fp32 shard only
            self.optimizer = self._adamw(groups=self.zero.param_groups(o.weight_decay))
        else:
            self.optimizer = self._adamw(list(self.model.parameters()))
        total = cfg.training.steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_lambda(s, o.warmup_steps, total, o.lr, o.min_lr))

        t = cfg.training
        self.sampler = DistributedBatchSampler(self.train_tokens, m.block_size, t.global_batch_size,
                                               topology.dp_rank, topology.dp, seed=t.seed)
        self.step = 0
        self.out_dir = Path(t.out_dir)
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl", enabled=self.is_main)
        self.history: list[float] = []

    def _adamw(self, params: list | None = None, groups: list | None = None):
        """AdamW with weight decay on matrices only (embeddings and linear weights)."""
        o = self.cfg.optimizer
        if groups is None:
            groups = [{"params": [q for q in params if q.dim() >= 2], "weight_decay": o.weight_decay},
                      {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), foreach=False)

    # -- one step -------------------------------------------------------------------------
    @property
    def net(self):
        return self.ddp or self.zero or self.model

    def _mean_over_dp(self, value: float) -> float:
        if not self.distributed or self.topology.dp == 1:
            return value
        # NCCL reduces device tensors only; float32 because not every backend has float64
        t = torch.tensor([value], dtype=torch.float32, device=self.device)
        comm.all_reduce(t, op="mean", group=self.topology.groups.dp, check=False)  # fixed shape
        return t.item()

    def train_step(self) -> dict:
        """One optimizer step on this rank's share of the next global batch."""
        m = self.cfg.parallel.micro_batches
        x, y = self.sampler.next_batch()
        x, y = x.to(self.device), y.to(self.device)
        if self.pipeline is not None:  # the schedule runs the m micro-batches and the step
            loss = self.pipeline.train_step(x, y)  # mean over micro-batches and dp replicas
            self.scheduler.step()
            self.step += 1
            self.history.append(loss)
            return {"loss": loss, "lr": self.optimizer.param_groups[0]["lr"]}
        wrapper = self.ddp or self.zero
        if wrapper is not None:
            wrapper.zero_grad()  # gradients stay views into the communication buckets
        else:
            self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m))):
            last = i == m - 1
            ctx = wrapper.no_sync() if (wrapper is not None and not last) else _null()
            with ctx:
                _, loss = self.net(xm, ym)
                (self.zero.scale_loss(loss / m) if self.zero else loss / m).backward()
            loss_sum += loss.item()
        clip = self.cfg.optimizer.grad_clip
        skipped = False
        if self.zero is not None:  # unscale, overflow check, clip by global norm, step, gather
            out = self.zero.step(self.optimizer, clip)
            gnorm, skipped = out["grad_norm"], out["skipped"]
        elif self.tp is not None:  # sharded gradients: squares summed over the tp group
            if self.tp.sequence_parallel:
                tp.sync_replicated_grads(self.model, self.tp)
            gnorm = tp.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else math.inf,
                                       self.tp)
            self.optimizer.step()
        else:  # gradients are already averaged over dp, so the local norm is the global norm
            gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                   clip if clip > 0 else float("inf"))
            self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        loss = self._mean_over_dp(loss_sum / m)
        self.history.append(loss)
        info = {"loss": loss, "grad_norm": float(gnorm), "lr": self.optimizer.param_groups[0]["lr"]}
        if self.loss_scaler is not None:
            info |= {"loss_scale": self.loss_scaler.scale, "skipped": skipped}
        if self.ddp is not None and self.ddp.last_timing is not None:
            # seconds before the end of backward at which each bucket's all-reduce started
            # (positive: overlapped with backward), and how long backward then waited for them
            t = self.ddp.last_timing
            info["bucket_launch_before_backward_end_s"] = [
                round(b["launched_before_end_s"], 6) for b in t["buckets"]]
            info["allreduce_wait_after_backward_s"] = round(t["wait_after_end_s"], 6)
        return info

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss (nats/char) over a fixed set of held-out windows."""
        t, m = self.cfg.training, self.cfg.model
        local = max(1, t.global_batch_size // self.topology.dp)
        n_windows = (len(self.val_tokens) - 1) // m.block_size
        total = min(n_windows, t.eval_batches * local * self.topology.dp)
        per_rank = max(1, total // self.topology.dp)
        start = self.topology.dp_rank * per_rank
        idx = torch.arange(start, min(start + per_rank, n_windows))
        starts = idx * m.block_size
        offs = torch.arange(m.block_size + 1)
        w = self.val_tokens[starts[:, None] + offs[None, :]].to(self.device)
        self.model.eval()
        if self.pipeline is not None:
            losses = [pipeline_loss(self.pipeline, xb, yb, self.gpt_cfg.n_embd)
                      for xb, yb in zip(w[:, :-1].split(local), w[:, 1:].split(local))]
        else:
            losses = [self.net(xb, yb)[1].item() for xb, yb in  # ZeRO-3 gathers in its hooks
                      zip(w[:, :-1].split(local), w[:, 1:].split(local))]
        self.model.train()
        return self._mean_over_dp(sum(losses) / len(losses))

    # -- the loop -------------------------------------------------------------------------
    def fit(self, progress: bool | None = None) -> dict:
        """Train until ``training.steps``; returns the final train and validation loss."""
        t, ck = self.cfg.training, self.cfg.checkpoint
        show = self.is_main and (t.progress if progress is None else progress)
        bar = None
        if show:
            import threading

            from tqdm import tqdm

            tqdm.set_lock(threading.RLock())  # tqdm's default multiprocessing lock leaks a semaphore at os._exit
            import sys

            # a terminal gets a live bar; a log file gets a line every 30 s, not every step
            bar = tqdm(total=t.steps, initial=self.step, desc="train", unit="step",
                       dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 30.0)
        tokens_per_step = t.global_batch_size * self.cfg.model.block_size
        started = time.perf_counter()
        val_loss = None
        while self.step < t.steps:
            t0 = time.perf_counter()
            info = self.train_step()
            dt = time.perf_counter() - t0
            if not math.isfinite(info["loss"]):  # every rank sees the same (dp-mean) loss
                raise NonFiniteLossError(
                    f"training loss is {info['loss']} at step {self.step}: stopped; nothing of "
                    "this step is saved (lower optimizer.lr or check the data)")
            rec = {"kind": "train", "step": self.step, **info, "tokens_per_s": tokens_per_step / dt,
                   "step_s": dt}
            if self.step % t.log_every == 0 or self.step == t.steps:
                self.metrics.write(rec)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{info['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                refresh=False)  # the bar redraws at its own mininterval
            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
                val_loss = self._log_eval()
            if ck.every and self.step % ck.every == 0 and self.step < t.steps:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        if self.pipeline is not None and self.topology.dp_rank == 0:  # for `shardwise timeline`
            p = self.cfg.parallel
            self.pipeline.save_timeline(self.out_dir, title=f"{p.schedule}, pp={self.topology.pp}, "
                                        f"m={p.micro_batches}, last training step")
        if self.pipeline is not None:  # PipeDream: the last micro-batches' backwards
            self.pipeline.drain()
        val_loss = self._log_eval()
        if ck.at_end:
            self.save_checkpoint()
        return {"step": self.step, "loss": self.history[-1] if self.history else None,
                "val_loss": val_loss, "elapsed_s": time.perf_counter() - started}

    def _log_eval(self) -> float:
        v = self.evaluate()
        self.metrics.write({"kind": "val", "step": self.step, "val_loss": v})
        if self.is_main and self.cfg.training.progress:
            from tqdm import tqdm

            tqdm.write(f"step {self.step}: validation loss {v:.4f} nats/char")
        return v

    def finish(self) -> None:
        """Rank 0: loss-curve PNG and a generated sample, printed. Call on every rank."""
        with self._full_parameters():
            if self.is_main:
                self._write_outputs()
            elif (self.tp is not None or self.pipeline is not None) and self.topology.dp_rank == 0:
                self._sample()  # generation is collective over rank 0's tp / pp group

    def _full_parameters(self):
        """Every parameter materialised on this rank (collective under ZeRO-3)."""
        return self.zero.full_parameters() if self.zero is not None else contextlib.nullcontext()

    def _write_outputs(self) -> None:
        png = plot_loss(self.out_dir / "metrics.jsonl", self.out_dir / "loss.png",
                        title=f"GPT on Shakespeare, dp={self.topology.dp}")
        print(f"loss curve: {png}")
        if self.cfg.training.sample_chars:
            text = self._sample()
            (self.out_dir / "sample.txt").write_text(text)
            print("sample:\n" + text)

    def _sample(self) -> str:
        g = torch.Generator(device=self.device).manual_seed(self.cfg.training.seed)
        prompt = self.tokenizer.encode("\n").view(1, 1).to(self.device)
        n = self.cfg.training.sample_chars
        if self.pipeline is not None:
            out = pipeline_generate(self.pipeline, prompt, n, self.gpt_cfg.block_size,
                                    self.gpt_cfg.n_embd, generator=g)
        else:
            out = self.model.generate(prompt, n, generator=g)
        return self.tokenizer.decode(out[0].tolist())


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
