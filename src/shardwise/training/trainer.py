"""The training loop: warm-up + cosine LR, validation, metrics, checkpoints, samples.

``Trainer(cfg, topology, device)`` builds the data and one ``engine.Engine`` for this rank
(whatever the layout: the engine composes dp, tp, pp, ZeRO and precision); ``fit()`` runs
the loop. It also runs without ``torch.distributed`` (one process, dp=1),
which is how parity tests build their single-process reference.

Resume state is explicit: ``state_dict()`` returns ``(tensors, meta)`` — tensors go to
DCP, meta (JSON) beside them — and ``load_state_dict`` restores both.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.base.config import Config
from shardwise.data import CharTokenizer, DistributedBatchSampler, load_text
from shardwise.engine import Engine, EngineSettings, settle
from shardwise.base.errors import NonFiniteLossError
from shardwise.training.metrics import MetricsLog, plot_loss
from shardwise.models import GPTConfig
from shardwise.perf import Throughput, cpu_peak, flops_per_token, peak_flops
from shardwise.base.topology import Topology
from shardwise.training.state import TrainerState


def lr_lambda(step: int, warmup: int, total: int, lr: float, min_lr: float) -> float:
    """Multiplier of ``lr`` at ``step``: linear warm-up, then cosine down to ``min_lr``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return (min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))) / lr


class Trainer(TrainerState):
    """One rank's view of a training run in any layout (see module docstring)."""

    def __init__(self, cfg: Config, topology: Topology, device: torch.device | None = None,
                 tokenizer: CharTokenizer | None = None):
        self.cfg, self.topology = cfg, topology
        self.device = device or torch.device("cpu")
        if self.device.type == "cuda":  # TF32 for fp32 matmuls (training.tf32); CPU: no effect
            torch.set_float32_matmul_precision("high" if cfg.training.tf32 else "highest")
        self.distributed = dist.is_initialized()
        self.is_main = topology.rank == 0
        text = load_text(cfg.data.path)
        self.tokenizer = tokenizer or CharTokenizer.from_text(text)
        tokens = self.tokenizer.encode(text)
        n_val = max(cfg.model.block_size + 1, int(len(tokens) * cfg.data.val_fraction))
        self.train_tokens, self.val_tokens = tokens[:-n_val], tokens[-n_val:]

        m, o, t = cfg.model, cfg.optimizer, cfg.training
        self.gpt_cfg = GPTConfig(vocab_size=m.vocab_size or self.tokenizer.vocab_size,
                                 block_size=m.block_size, n_layer=m.n_layer, n_head=m.n_head,
                                 n_embd=m.n_embd, dropout=m.dropout, bias=m.bias,
                                 tie_weights=m.tie_weights, attention=m.attention)
        # split, then parallelize: pipeline chunks, tp shards, dp sync, one optimizer
        self.engine = Engine(self.gpt_cfg, topology, EngineSettings.from_config(cfg), self.device)
        self.optimizer = self.engine.optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer.optimizer, lambda s: lr_lambda(s, o.warmup_steps, t.steps, o.lr, o.min_lr))
        self.sampler = DistributedBatchSampler(self.train_tokens, m.block_size, t.global_batch_size,
                                               topology.dp_rank, topology.dp, seed=t.seed)
        self.step = 0
        self.out_dir = Path(t.out_dir)
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl", enabled=self.is_main)
        self.history: list[float] = []
        self._pending: list[torch.Tensor] = []  # losses of steps not yet read on the host
        self._pin = self.device.type == "cuda"  # page-locked batches, copied asynchronously

    # -- one step -------------------------------------------------------------------------
    def train_step(self, sync: bool = True) -> dict:
        """One optimizer step on this rank's share of the next global batch. ``sync=False``:
        the loss and norm stay 0-d tensors on the device (``settle`` reads them), so the host
        runs ahead of the GPU; ``self.history`` gets them at the next ``settle``."""
        x, y = self.sampler.next_batch()
        if self._pin:
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        info = self.engine.train_step(x, y, sync=False)
        self.scheduler.step()
        self.step += 1
        self._pending.append(info["loss"])
        info = {**info, "lr": self.optimizer.param_groups[0]["lr"]}
        if self.engine.loss_scaler is None:
            info.pop("skipped")
        else:
            info["loss_scale"] = self.engine.loss_scaler.scale
        return self.settle(info) if sync else info

    def settle(self, info: dict | None = None) -> dict | None:
        """Read the pending losses into ``self.history`` (one host synchronisation) and
        ``info``'s tensors into floats. Raises ``NonFiniteLossError`` naming the first step
        whose loss is not finite (every rank sees the same dp-mean loss)."""
        if self._pending:
            first = self.step - len(self._pending) + 1
            losses = torch.stack([t.detach().double().reshape(()) for t in self._pending]).tolist()
            self._pending = []
            for i, v in enumerate(losses):
                if not math.isfinite(v):
                    raise NonFiniteLossError(
                        f"training loss is {v} at step {first + i}: stopped; nothing of this "
                        "or later steps is saved (lower optimizer.lr or check the data)")
            self.history.extend(losses)
        return settle(info) if info is not None else None

    def _mean_over_dp(self, value: float) -> float:
        if not self.distributed or self.topology.dp == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        comm.all_reduce(t, op="mean", group=self.topology.groups.dp, check=False)  # fixed shape
        return float(t)

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
        losses = [self.engine.loss(xb, yb)
                  for xb, yb in zip(w[:, :-1].split(local), w[:, 1:].split(local))]
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
        rate = self.throughput()
        started = time.perf_counter()
        val_loss = None
        while self.step < t.steps:
            info = self.train_step(sync=False)
            rate.add(tokens_per_step)
            log = self.step % t.log_every == 0 or self.step == t.steps
            evaluate = bool(t.eval_every) and self.step % t.eval_every == 0 and self.step < t.steps
            save = bool(ck.every) and self.step % ck.every == 0 and self.step < t.steps
            if log or evaluate or save:  # the only host synchronisations of the loop
                info = self.settle(info)
                rate.pause()
            if log:
                rec = {"kind": "train", "step": self.step, **info, **rate.mark()}
                self.metrics.write(rec)
                if bar is not None:
                    mfu = f"{100 * rec['mfu']:.0f}%" if rec["mfu"] is not None else "n/a"
                    bar.set_postfix(loss=f"{info['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                    mfu=mfu, refresh=False)  # the bar redraws at its own mininterval
            if bar is not None:
                bar.update(1)
            if evaluate:
                val_loss = self._log_eval()
            if save:
                self.save_checkpoint()
            rate.resume()
        if bar is not None:
            bar.close()
        if self.topology.pp > 1 and self.topology.dp_rank == 0:  # for `shardwise timeline`
            self._save_timeline()
        self.engine.drain()  # PipeDream: the last micro-batches' backwards
        val_loss = self._log_eval()
        if ck.at_end:
            self.save_checkpoint()
        return {"step": self.step, "loss": self.history[-1] if self.history else None,
                "val_loss": val_loss, "elapsed_s": time.perf_counter() - started}

    def throughput(self) -> Throughput:
        """Tokens/s, FLOP/s per rank and MFU of this run (``perf``), against the peak of this
        rank's device in the compute dtype."""
        t = self.cfg.training
        peak = peak_flops(self.device, self.engine.dtype, t.tf32, t.peak_tflops)
        world = self.topology.dp * self.topology.pp * self.topology.tp
        return Throughput(flops_per_token(self.gpt_cfg), world, peak)

    def _log_eval(self) -> float:
        v = self.evaluate()
        self.metrics.write({"kind": "val", "step": self.step, "val_loss": v})
        if self.is_main and self.cfg.training.progress:
            from tqdm import tqdm

            tqdm.write(f"step {self.step}: validation loss {v:.4f} nats/char")
        return v

    def finish(self) -> None:
        """Rank 0: loss-curve PNG and a generated sample, printed. Call on every rank:
        generation is collective over dp replica 0's tp and pp groups."""
        with self.engine.full_parameters():  # ZeRO-3: gathered once (collective over dp)
            if self.is_main:
                self._write_outputs()
            elif self.topology.dp_rank == 0 and self.cfg.training.sample_chars:
                self._sample()

    def _save_timeline(self) -> None:
        p = self.cfg.parallel
        self.engine.save_timeline(self.out_dir, f"{p.schedule}, pp={self.topology.pp}, "
                                  f"m={p.micro_batches}, last training step")

    def _write_outputs(self) -> None:
        png = plot_loss(self.out_dir / "metrics.jsonl", self.out_dir / "loss.png",
                        title=f"GPT on Shakespeare, {describe_layout(self.cfg)}")
        print(f"loss curve: {png}")
        if self.cfg.training.sample_chars:
            text = self._sample()
            (self.out_dir / "sample.txt").write_text(text)
            print("sample:\n" + text)

    def _sample(self) -> str:
        g = torch.Generator(device=self.device).manual_seed(self.cfg.training.seed)
        prompt = self.tokenizer.encode("\n").view(1, 1).to(self.device)
        out = self.engine.generate(prompt, self.cfg.training.sample_chars, generator=g)
        return self.tokenizer.decode(out[0].tolist())


def build_trainer(cfg: Config) -> Trainer:
    """A ``Trainer`` for ``cfg`` on this rank: the rank grid of ``cfg.parallel`` over the
    initialised process group (its groups created, collectively), or one process without
    ``torch.distributed``."""
    from shardwise.base.topology import init_process_groups

    p = cfg.parallel
    if dist.is_initialized():
        topo = init_process_groups(Topology.build(p.dp, p.pp, p.tp, rank=dist.get_rank(),
                                                  world_size=dist.get_world_size()))
    else:
        topo = Topology.build(p.dp, p.pp, p.tp)
    return Trainer(cfg, topo)


def describe_layout(cfg: Config) -> str:
    """``dp=2`` / ``dp=1 x pp=2 (pipedream, m=4)`` / ``dp=2 x tp=2 (SP)``, ZeRO and precision."""
    p = cfg.parallel
    parts = [f"dp={p.dp}"]
    if p.pp > 1:
        v = f", v={p.chunks_per_rank}" if p.schedule == "interleaved" else ""
        parts.append(f"pp={p.pp} ({p.schedule}, m={p.micro_batches}{v})")
    if p.tp > 1:
        parts.append(f"tp={p.tp}" + (" (SP)" if p.sequence_parallel else ""))
    extra = (f", ZeRO-{p.zero}" if p.zero else "") + (
        f", {cfg.training.precision}" if cfg.training.precision != "fp32" else "")
    return " x ".join(parts) + extra
