"""Training with a parameter server: the per-rank entry point and the worker's loop.

Ranks ``0..S-1`` are servers, ``S..S+W-1`` workers (``ps.servers``, ``ps.workers``). Every
rank builds the GPT from ``training.seed`` (so servers and workers start from the same
weights) and the key-range partition. Worker w trains on slice w of each global batch of
``DistributedBatchSampler`` (the same global batches one process would draw), so under BSP
the mean of the workers' gradients is the full-batch gradient and training equals
synchronous data parallelism. A worker's clocks run in the shared loop
(``training.loop.run_loop``, through ``PSWorkerTask``); servers run ``Server.serve()``.
Run with::

    shardwise train --parallel.mode ps --ps.servers 2 --ps.workers 2 --ps.consistency ssp \\
        --ps.staleness 2 --optimizer.grad_clip 0
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise import checkpoint, comm
from shardwise.apps.lm.model import gpt_config
from shardwise.apps.lm.text import split_corpus
from shardwise.apps.param_server.partition import partition
from shardwise.apps.param_server.server import Server
from shardwise.apps.param_server.worker import Worker
from shardwise.base.config import Config
from shardwise.data import DistributedBatchSampler
from shardwise.models import GPT
from shardwise.perf import flops_per_token
from shardwise.training.loop import Cadence, TrainTask, run_loop
from shardwise.training.metrics import plot_loss


def _data_and_model(cfg: Config, device: torch.device):
    """``(train_tokens, val_tokens, model)``: the language model's split of ``data.path``
    and its GPT (``apps.lm.model.gpt_config``, every ``[model]`` field) from
    ``training.seed``, on ``device``."""
    tok, train_tokens, val_tokens = split_corpus(cfg)
    torch.manual_seed(cfg.training.seed)
    return train_tokens, val_tokens, GPT(gpt_config(cfg.model, tok.vocab_size)).to(device)


def straggle(slow: tuple[int, float] | None, index: int, clock: int, workers: int,
             seed: int) -> float:
    """Slow-down factor of worker ``index`` at ``clock`` (``ps.slow_worker``): a fixed
    worker always, or (index -1) one worker per clock drawn from ``seed`` and the clock."""
    if slow is None:
        return 1.0
    who = slow[0] if slow[0] >= 0 else random.Random(seed * 1_000_003 + clock).randrange(workers)
    return slow[1] if who == index else 1.0


@torch.no_grad()
def evaluate(model: torch.nn.Module, val_tokens: torch.Tensor, cfg: Config,
             device: torch.device) -> float:
    """Mean validation loss (nats/char) over the first ``eval_batches`` global batches of
    held-out windows (the trainer's windows with dp = 1)."""
    t, T = cfg.training, cfg.model.block_size
    n_windows = (len(val_tokens) - 1) // T
    idx = torch.arange(min(n_windows, t.eval_batches * t.global_batch_size))
    w = val_tokens[idx[:, None] * T + torch.arange(T + 1)[None, :]].to(device)
    model.eval()
    losses = [model(xb, yb)[1].item() for xb, yb in
              zip(w[:, :-1].split(t.global_batch_size), w[:, 1:].split(t.global_batch_size))]
    model.train()
    return sum(losses) / len(losses)


class _Stopped(Exception):
    """``stop_after`` reached: the worker leaves without DONE, as if killed."""


class PSWorkerTask(TrainTask):
    """Worker ``index``'s clocks as ``run_loop`` drives them: pull, forward/backward on its
    slice of the global batch, push (``step`` is the clock). Rows of ``metrics.jsonl`` (worker
    0) add ``time_s`` (since the first clock) and ``pull_wait_s``; throughput counts this
    worker's tokens and FLOPs. Evaluations during the run (worker 0, every
    ``training.eval_every`` clocks) read the weights just pulled, so they happen inside the
    step; the loop evaluates only at the end, on the final weights."""

    def __init__(self, cfg: Config, index: int, device: torch.device, start_clock: int,
                 stop_after: int | None, pauses: dict[int, float] | None):
        ps, t = cfg.ps, cfg.training
        self.cfg, self.index, self.device = cfg, index, device
        self.is_main = index == 0
        self.stop_after, self.pauses = stop_after, pauses or {}
        self.train_tokens, self.val_tokens, self.model = _data_and_model(cfg, device)
        self.part = partition(self.model, ps.servers)
        self.worker = Worker(index, self.model, self.part, list(range(ps.servers)))
        torch.manual_seed(t.seed + 1000 * (index + 1))  # dropout streams differ per worker
        self.sampler = DistributedBatchSampler(self.train_tokens, cfg.model.block_size,
                                               t.global_batch_size, index, ps.workers,
                                               seed=t.seed)
        epoch, batch = divmod(start_clock, self.sampler.batches_per_epoch)
        self.sampler.load_state_dict(self.sampler.state_dict()
                                     | {"epoch": epoch, "batch_in_epoch": batch})
        self.step = self.start_clock = start_clock
        self.slow = ps.slow()
        self.losses, self.times, self.waits, self.evals, self.first_versions = [], [], [], [], []
        self.history = []
        self.started = time.perf_counter()
        self.cadence = Cadence(t.log_every)  # servers checkpoint; evaluations: see above
        self.sample_unit = "tokens"
        self.samples_per_step = t.global_batch_size // ps.workers * cfg.model.block_size
        self.flops_per_sample = flops_per_token(self.model.cfg)

    def train_step(self, sync: bool = True) -> dict:
        """One clock of this worker: pull the weights, compute a gradient on its batch (clipped on
        its own), push it. Returns ``loss``, ``time_s`` and ``pull_wait_s`` (seconds waiting for the
        pull)."""
        t, clock, w = self.cfg.training, self.step, self.worker
        if clock == self.stop_after:
            raise _Stopped
        if clock in self.pauses:
            time.sleep(self.pauses[clock])
        t0 = time.perf_counter()
        w.pull(clock)
        if clock == self.start_clock:
            self.first_versions = list(w.versions)  # a late joiner sees updates made before it
        if self.index == 0 and t.eval_every and clock % t.eval_every == 0:  # the weights read now
            self.evals.append((clock, t0 - self.started,
                               evaluate(self.model, self.val_tokens, self.cfg, self.device)))
        t1 = time.perf_counter()
        x, y = self.sampler.next_batch()
        w.grad.zero_()
        _, loss = self.model(x.to(self.device), y.to(self.device))
        loss.backward()
        clip = self.cfg.optimizer.grad_clip
        if clip > 0:  # each worker clips its own gradient (no global norm across workers)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        factor = straggle(self.slow, self.index, clock, self.cfg.ps.workers, t.seed)
        if factor > 1.0:  # the straggler knob: this worker's compute takes factor x as long
            time.sleep((factor - 1.0) * (time.perf_counter() - t1))
        w.push(clock)
        self.step += 1
        self.losses.append(loss.item())
        self.times.append(time.perf_counter() - self.started)
        self.waits.append(t1 - t0)
        self.record_loss(self.losses[-1])
        return {"loss": self.losses[-1], "time_s": self.times[-1], "pull_wait_s": t1 - t0}

    def end_of_training(self) -> None:
        """DONE to every server; worker 0 receives the final weights."""
        self.worker.finish(self.cfg.training.steps, final=self.index == 0)

    def evaluate(self) -> dict | None:
        """Worker 0 only: ``val_loss`` of the weights it holds now (None on other workers)."""
        if self.index != 0:
            return None
        v = evaluate(self.model, self.val_tokens, self.cfg, self.device)
        self.evals.append((self.step, time.perf_counter() - self.started, v))
        return {"val_loss": v}

    def eval_line(self, row: dict) -> str:
        """The progress line of a validation row, in nats per character."""
        return f"step {row['step']}: validation loss {row['val_loss']:.4f} nats/char"


def run_worker(cfg: Config, index: int, device: torch.device, stop_after: int | None = None,
               join_after: int = 0, start_clock: int = 0,
               pauses: dict[int, float] | None = None) -> dict:
    """Worker ``index``'s loop: pull, forward/backward on its shard, push; ``training.steps``
    clocks. Returns its ``losses``, wall-clock ``times`` and ``pull_wait_s`` (seconds, one
    per clock), ``evals`` (``(clock, seconds, val_loss)``), ``first_versions`` (the servers'
    update counts at its first pull), and ``run_loop``'s ``step``, ``loss``, ``elapsed_s``;
    worker 0 also the final weights (``params``) and ``val_loss``. ``start_clock``: resume
    there (the sampler skips that many batches).

    Fault injection (tests, experiments): ``stop_after`` clocks, the worker falls silent
    and leaves without DONE, as if killed (returns ``losses`` and ``stopped``);
    ``join_after``: it joins a running job once server 0 has applied that many updates
    (polling pulls; ASP only, since under BSP/SSP the others would wait for it), starting
    from the weights as they are then; ``pauses``: ``{clock: seconds}``, it stalls before
    those clocks (if longer than ``ps.worker_timeout_s``, it is dropped, then taken back
    when it speaks again). ``ps.slow_worker``: the straggler (``straggle``).
    """
    ps, t = cfg.ps, cfg.training
    task = PSWorkerTask(cfg, index, device, start_clock, stop_after, pauses)
    if index == 0 and t.progress:
        rule = f"ssp s={ps.staleness}" if ps.consistency == "ssp" else ps.consistency
        print(f"shardwise: parameter server, {ps.servers} servers x {ps.workers} workers, "
              f"{rule}, {ps.optimizer}; GPT {task.model.num_parameters() / 1e6:.2f}M "
              f"parameters, attention {task.model.cfg.attention}, server bytes "
              f"{task.part.server_bytes()}"
              + (f"; resumed at clock {start_clock}" if start_clock else ""), flush=True)
    while join_after and task.worker.versions[0] < join_after:
        task.worker.pull(start_clock)
        time.sleep(0.05)
    task.started = time.perf_counter()
    try:
        summary = run_loop(task)
    except _Stopped:
        return {"role": "worker", "index": index, "losses": task.losses,
                "stopped": task.step}
    out = {"role": "worker", "index": index, "losses": task.losses, "times": task.times,
           "pull_wait_s": task.waits, "evals": task.evals,
           "first_versions": task.first_versions, **summary}
    if index == 0:
        if t.progress:  # a CLI run: the loss curve, as the language model draws it
            png = plot_loss(Path(t.out_dir) / "metrics.jsonl", Path(t.out_dir) / "loss.png",
                            title=f"GPT on Shakespeare, parameter server {ps.consistency}, "
                                  f"S={ps.servers}, W={ps.workers}", unit="char")
            print(f"loss curve: {png}", flush=True)
        out["params"] = {n: p.detach().clone() for n, p in task.model.named_parameters()}
    return out


def run_server(cfg: Config, index: int, device: torch.device, group=None,
               resume_from=None) -> dict:
    """Server ``index``: serve until the workers are done; checkpoints collectively over
    ``group`` (the servers' process group) when ``checkpoint.every`` / ``at_end`` ask."""
    ps, ck = cfg.ps, cfg.checkpoint
    _, _, model = _data_and_model(cfg, device)
    part = partition(model, ps.servers)
    values = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    del model
    server = Server(index, part, values, [ps.servers + w for w in range(ps.workers)],
                    ps.consistency, ps.staleness or 0, ps.optimizer, cfg.optimizer,
                    cfg.training.steps, ps.momentum, ps.worker_timeout_s,
                    checkpointing={"root": cfg.checkpoint_dir, "every": ck.every, "keep": ck.keep,
                                   "at_end": ck.at_end, "group": group,
                                   "meta": {"layout": f"ps S={ps.servers} W={ps.workers}",
                                            "consistency": ps.consistency,
                                            "optimizer": ps.optimizer,
                                            "config": cfg.model_dump()}},
                    resume_from=resume_from)
    return server.serve()


def train_rank(cfg_dict: dict, device: torch.device | None = None, resume: bool = False) -> dict:
    """Entry point of every rank of a parameter-server job (``torch.distributed`` is up
    with ``ps.servers + ps.workers`` ranks). ``resume``: servers load the latest complete
    checkpoint under ``checkpoint_dir`` (any earlier S) and workers start at its clock."""
    cfg = Config.from_dict(cfg_dict)
    if dist.get_world_size() != cfg.world_size:
        raise ValueError(f"ps.servers + ps.workers = {cfg.world_size} ranks, but the job has "
                         f"{dist.get_world_size()}")
    comm.configure(timeout_s=cfg.parallel.timeout_s)
    device = device or (torch.device("cuda", torch.cuda.current_device())
                        if torch.cuda.is_available() else torch.device("cpu"))
    rank, S = dist.get_rank(), cfg.ps.servers
    group = dist.new_group(list(range(S)))  # every rank takes part in creating it
    latest = checkpoint.latest_checkpoint(cfg.checkpoint_dir) if resume else None
    if resume and latest is None:
        raise checkpoint.CheckpointError(f"--resume: no complete checkpoint in "
                                         f"{str(cfg.checkpoint_dir)!r}")
    if rank < S:
        return run_server(cfg, rank, device, group, latest)
    start = int(checkpoint.read_meta(latest)["applied"]) if latest is not None else 0
    return run_worker(cfg, rank - S, device, start_clock=start)

