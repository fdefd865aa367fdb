"""Training with a parameter server: the per-rank entry point and the worker's loop.

Ranks ``0..S-1`` are servers, ``S..S+W-1`` workers (``ps.servers``, ``ps.workers``). Every
rank builds the GPT from ``training.seed`` (so servers and workers start from the same
weights) and the key-range partition. Worker w trains on slice w of each global batch of
``DistributedBatchSampler`` (the same global batches one process would draw), so under BSP
the mean of the workers' gradients is the full-batch gradient and training equals
synchronous data parallelism. Run with::

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
from shardwise.base.config import Config
from shardwise.data import CharTokenizer, DistributedBatchSampler, load_text
from shardwise.training.metrics import MetricsLog, plot_loss
from shardwise.models import GPT, GPTConfig
from shardwise.apps.param_server.partition import partition
from shardwise.apps.param_server.server import Server
from shardwise.apps.param_server.worker import Worker


def _data_and_model(cfg: Config, device: torch.device):
    text = load_text(cfg.data.path)
    tok = CharTokenizer.from_text(text)
    tokens = tok.encode(text)
    n_val = max(cfg.model.block_size + 1, int(len(tokens) * cfg.data.val_fraction))
    m = cfg.model
    torch.manual_seed(cfg.training.seed)
    model = GPT(GPTConfig(vocab_size=m.vocab_size or tok.vocab_size, block_size=m.block_size,
                          n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd,
                          dropout=m.dropout, bias=m.bias, tie_weights=m.tie_weights)).to(device)
    return tokens[:-n_val], tokens[-n_val:], model


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


def run_worker(cfg: Config, index: int, device: torch.device, stop_after: int | None = None,
               join_after: int = 0, start_clock: int = 0,
               pauses: dict[int, float] | None = None) -> dict:
    """Worker ``index``'s loop: pull, forward/backward on its shard, push; ``training.steps``
    clocks. Returns its losses and wall-clock times (worker 0 also the final weights and
    validation loss). ``start_clock``: resume there (the sampler skips that many batches).

    Fault injection (tests, experiments): ``stop_after`` clocks, the worker falls silent
    and leaves without DONE, as if killed; ``join_after``: it joins a running job once
    server 0 has applied that many updates (polling pulls; ASP only, since under BSP/SSP
    the others would wait for it), starting from the weights as they are then; ``pauses``:
    ``{clock: seconds}``, it stalls before those clocks (if longer than
    ``ps.worker_timeout_s``, it is dropped, then taken back when it speaks again).
    """
    ps, t = cfg.ps, cfg.training
    train_tokens, val_tokens, model = _data_and_model(cfg, device)
    part = partition(model, ps.servers)
    if index == 0 and t.progress:
        rule = f"ssp s={ps.staleness}" if ps.consistency == "ssp" else ps.consistency
        print(f"shardwise: parameter server, {ps.servers} servers x {ps.workers} workers, "
              f"{rule}, {ps.optimizer}; GPT {model.num_parameters() / 1e6:.2f}M parameters, "
              f"server bytes {part.server_bytes()}"
              + (f"; resumed at clock {start_clock}" if start_clock else ""), flush=True)
    worker = Worker(index, model, part, list(range(ps.servers)))
    torch.manual_seed(t.seed + 1000 * (index + 1))  # dropout streams differ per worker
    sampler = DistributedBatchSampler(train_tokens, cfg.model.block_size, t.global_batch_size,
                                      index, ps.workers, seed=t.seed)
    epoch, batch = divmod(start_clock, sampler.batches_per_epoch)
    sampler.load_state_dict(sampler.state_dict() | {"epoch": epoch, "batch_in_epoch": batch})
    slow = ps.slow()
    clip = cfg.optimizer.grad_clip
    metrics = MetricsLog(Path(t.out_dir) / "metrics.jsonl", enabled=index == 0)
    losses, times, waits, evals = [], [], [], []
    while join_after and worker.versions[0] < join_after:
        worker.pull(start_clock)
        time.sleep(0.05)
    started = time.perf_counter()
    out_first = []
    for clock in range(start_clock, t.steps):
        if clock == stop_after:
            return {"role": "worker", "index": index, "losses": losses, "stopped": clock}
        if pauses and clock in pauses:
            time.sleep(pauses[clock])
        t0 = time.perf_counter()
        worker.pull(clock)
        if clock == start_clock:
            out_first = list(worker.versions)  # a late joiner sees updates made before it
        if index == 0 and t.eval_every and clock % t.eval_every == 0:  # the weights read now
            evals.append((clock, t0 - started, evaluate(model, val_tokens, cfg, device)))
        t1 = time.perf_counter()
        x, y = sampler.next_batch()
        worker.grad.zero_()
        _, loss = model(x.to(device), y.to(device))
        loss.backward()
        if clip > 0:  # each worker clips its own gradient (no global norm across workers)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        factor = straggle(slow, index, clock, ps.workers, t.seed)
        if factor > 1.0:  # the straggler knob: this worker's compute takes factor x as long
            time.sleep((factor - 1.0) * (time.perf_counter() - t1))
        worker.push(clock)
        losses.append(loss.item())
        times.append(time.perf_counter() - started)
        waits.append(t1 - t0)
        if (clock + 1) % t.log_every == 0 or clock + 1 == t.steps:
            metrics.write({"kind": "train", "step": clock + 1, "loss": losses[-1],
                           "time_s": times[-1], "pull_wait_s": t1 - t0})
    worker.finish(t.steps, final=index == 0)
    out = {"role": "worker", "index": index, "losses": losses, "times": times,
           "pull_wait_s": waits, "evals": evals, "first_versions": out_first,
           "elapsed_s": time.perf_counter() - started, "step": t.steps,
           "loss": losses[-1] if losses else None}
    if index == 0:
        out["val_loss"] = evaluate(model, val_tokens, cfg, device)
        evals.append((t.steps, time.perf_counter() - started, out["val_loss"]))
        metrics.write({"kind": "val", "step": t.steps, "val_loss": out["val_loss"]})
        if t.progress:  # a CLI run: the loss curve, as the trainer draws it
            png = plot_loss(metrics.path, Path(t.out_dir) / "loss.png",
                            title=f"GPT on Shakespeare, parameter server {ps.consistency}, "
                                  f"S={ps.servers}, W={ps.workers}")
            print(f"loss curve: {png}", flush=True)
        out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
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
