"""Training the CNN with its per-layer plan: the per-rank entry point and the loop.

Selected by ``model.kind = "cnn"`` (``shardwise.apps.jobs.train_worker`` hands over here, as it
does to ``param_server`` for ``parallel.mode = "ps"``)::

    shardwise train --config configs/fashion_cnn.toml --data DIR/usr/share/datasets/fashion-mnist

Every rank reads Fashion-MNIST itself (``data.path``), holds out the last
``data.val_fraction`` of the training images for validation, draws the same global batches
(a permutation per epoch from ``training.seed``), and trains ``HybridCNN`` under the plan
``cnn.plan`` resolves to (printed first). Rank 0 shows the progress bar, writes
``metrics.jsonl`` and ``loss.png`` (loss and accuracy), and the run ends with the test-set
accuracy. Checkpoints (``shardwise.checkpoint``, DCP) hold the unsharded model and
optimizer state, so a run resumes under any plan or rank count.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise import checkpoint, comm
from shardwise.apps.cnn.app import cnn_config
from shardwise.apps.cnn.chooser import format_plan, resolve
from shardwise.apps.cnn.hybrid import HybridCNN
from shardwise.base.config import Config
from shardwise.data.idx import load_split
from shardwise.base.errors import NonFiniteLossError
from shardwise.training.metrics import MetricsLog, read_metrics
from shardwise.models.cnn import CNN
from shardwise.parallel.tensor_parallel import RankGroup, clip_grad_norm_
from shardwise.base.topology import Topology, init_process_groups
from shardwise.training.trainer import lr_lambda


class BatchSampler:
    """Global batches of indices into ``n`` samples: a fresh permutation per epoch from
    ``seed`` and the epoch, the tail that does not fill a batch dropped."""

    def __init__(self, n: int, batch: int, seed: int):
        if n < batch:
            raise ValueError(f"training.global_batch_size={batch} is more than the {n} "
                             "training images")
        self.n, self.batch, self.seed = n, batch, seed
        self.epoch, self.index = 0, 0
        self.per_epoch = n // batch

    def next(self) -> torch.Tensor:
        if self.index == self.per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        perm = torch.randperm(self.n, generator=g)
        self.index += 1
        return perm[(self.index - 1) * self.batch:self.index * self.batch]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, s: dict) -> None:
        self.epoch, self.index = int(s["epoch"]), int(s["index"])


def build(cfg: Config, group: RankGroup, device: torch.device):
    """The hybrid model for ``cfg`` on this rank (full CNN from ``training.seed``, then split)."""
    torch.manual_seed(cfg.training.seed)
    full = CNN(cnn_config(cfg.cnn))
    plan = resolve(cfg.cnn.plan, full.specs(), cfg.training.global_batch_size, cfg.cnn.ranks,
                   flops_per_s=cfg.cnn.flops_per_s)
    return HybridCNN(full, plan, group).to(device)


def make_optimizer(cfg: Config, model: HybridCNN) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if cfg.cnn.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=cfg.cnn.momentum,
                               weight_decay=o.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                             weight_decay=o.weight_decay)


def train_step(model: HybridCNN, opt, x, y, grad_clip: float = 0.0) -> tuple[float, int]:
    """One optimizer step on the global batch; this rank's loss / correct shares."""
    model.zero_grad()
    loss, correct = model.loss_and_backward(x, y)
    model.sync_gradients()
    if grad_clip > 0:
        clip_grad_norm_(list(model.parameters()), grad_clip, model.group)
    opt.step()
    return loss, correct


@torch.no_grad()
def evaluate(model: HybridCNN, x: torch.Tensor, y: torch.Tensor, batch: int,
             device) -> tuple[float, float, int]:
    """(mean loss, accuracy, samples) over ``x, y`` in chunks of ``batch`` (the last chunk
    trimmed to a multiple of the rank count)."""
    import torch.nn.functional as F

    from shardwise.apps.cnn.layout import BATCH, my_rows

    n_ranks, total, correct, seen = model.group.size, 0.0, 0, 0
    model.eval()
    for i in range(0, len(x), batch):
        xb, yb = x[i:i + batch], y[i:i + batch]
        keep = len(xb) - len(xb) % n_ranks
        if keep == 0:
            break
        xb, yb = xb[:keep].to(device), yb[:keep].to(device)
        logits, layout = model(xb)
        labels = my_rows(yb, model.group) if layout == BATCH else yb
        share = layout == BATCH or model.group.rank == 0
        total += float(F.cross_entropy(logits, labels, reduction="sum")) if share else 0.0
        correct += int((logits.argmax(-1) == labels).sum()) if share else 0
        seen += keep
    model.train()
    loss, correct = model.global_metrics(total, correct, device)
    return loss / max(1, seen), correct / max(1, seen), seen


# ------------------------------------------------------------------ checkpoints

def _opt_state(model: HybridCNN, opt) -> dict:
    out = {}
    for name, p in model.named_parameters():
        st = {}
        for k, v in opt.state.get(p, {}).items():
            if torch.is_tensor(v) and v.shape == p.shape and hasattr(p, "tp_dim"):
                from shardwise.parallel.tensor_parallel import gather_tensor

                v = gather_tensor(v, p.tp_dim, model.group)
            st[k] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(float(v))
        out[name] = st
    return out


def save(cfg: Config, model, opt, sched, sampler, step: int, history: list) -> Path:
    tensors = {"model": model.full_state(), "optimizer": _opt_state(model, opt)}
    meta = {"kind": "cnn", "step": step, "sampler": sampler.state_dict(),
            "scheduler": sched.state_dict(), "history": history, "config": cfg.model_dump(),
            "plan": model.plan.strategies, "layout": {"ranks": cfg.cnn.ranks}}
    return checkpoint.save(cfg.checkpoint_dir, step, tensors, meta, keep=cfg.checkpoint.keep)


def resume(path: Path, model: HybridCNN, opt, sched, sampler) -> dict:
    """Load ``path`` into this rank's shards (any plan or rank count saved it)."""
    from shardwise.parallel.tensor_parallel import shard_tensor

    meta = checkpoint.read_meta(path)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in CNN(model.cfg).named_parameters()}
    keys = ("momentum_buffer",) if isinstance(opt, torch.optim.SGD) else ("step", "exp_avg", "exp_avg_sq")
    dev = next(model.parameters()).device
    tensors = {"model": {n: torch.empty(s, device=dev) for n, s in shapes.items()},
               "optimizer": {n: {k: torch.empty(() if k == "step" else s, device=dev)
                                 for k in keys} for n, s in shapes.items()}}
    checkpoint.load(path, tensors)
    model.load_full_state(tensors["model"])
    for name, p in model.named_parameters():
        opt.state[p] = {k: (shard_tensor(v, p.tp_dim, model.group)
                            if v.dim() and hasattr(p, "tp_dim") else v.clone())
                        for k, v in tensors["optimizer"][name].items()}
    sched.load_state_dict(dict(meta["scheduler"]))
    sampler.load_state_dict(meta["sampler"])
    return meta


def plot(metrics_path: Path, png: Path, title: str) -> Path:
    """Loss (train, validation) and validation accuracy against step, one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    tr = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train"]
    va = [(r["step"], r["val_loss"], r["val_acc"]) for r in rows if r.get("kind") == "val"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    if tr:
        a1.plot(*zip(*tr), lw=1.0, label="train loss")
    if va:
        a1.plot([v[0] for v in va], [v[1] for v in va], "o-", label="validation loss")
        a2.plot([v[0] for v in va], [100 * v[2] for v in va], "o-", color="C2")
    a1.set(xlabel="optimizer step", ylabel="cross-entropy (nats)", title=title)
    a2.set(xlabel="optimizer step", ylabel="validation accuracy (%)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
    a1.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return png


# ------------------------------------------------------------------ the loop

def train_rank(cfg_dict: dict, device: torch.device | None = None,
               resume_from: bool | str = False) -> dict:
    """Entry point of every rank (``torch.distributed`` is up with ``cnn.ranks`` ranks)."""
    cfg = Config.from_dict(cfg_dict)
    t, ck = cfg.training, cfg.checkpoint
    comm.configure(timeout_s=cfg.parallel.timeout_s)
    topo = init_process_groups(Topology.build(dp=cfg.cnn.ranks, rank=dist.get_rank(),
                                              world_size=dist.get_world_size()))
    device = device or torch.device("cpu")
    group = RankGroup(group=topo.groups.dp, size=topo.dp, rank=topo.dp_rank,
                      all_reduce="ring", gather="ring")
    x_all, y_all = load_split(cfg.data.path, "train")
    n_val = max(1, int(len(x_all) * cfg.data.val_fraction))
    x_tr, y_tr, x_val, y_val = x_all[:-n_val], y_all[:-n_val], x_all[-n_val:], y_all[-n_val:]
    model = build(cfg, group, device)
    opt = make_optimizer(cfg, model)
    o = cfg.optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, o.warmup_steps, t.steps, o.lr, o.min_lr))
    sampler = BatchSampler(len(x_tr), t.global_batch_size, t.seed)
    is_main = topo.rank == 0
    out_dir = Path(t.out_dir)
    metrics = MetricsLog(out_dir / "metrics.jsonl", enabled=is_main)
    step, history = 0, []
    if resume_from:
        path = Path(resume_from) if isinstance(resume_from, str) else checkpoint.latest_checkpoint(cfg.checkpoint_dir)
        meta = resume(path, model, opt, sched, sampler)
        step, history = int(meta["step"]), list(meta["history"])
    if is_main:
        n = sum(s.params for s in model.plan.specs)
        print(f"shardwise: CNN {n / 1e6:.2f}M parameters, {len(x_tr):,} train / {len(x_val):,} "
              f"validation images, batch {t.global_batch_size}, {cfg.cnn.ranks} ranks, "
              f"{torch.get_num_threads()} threads per rank; plan:\n{format_plan(model.plan)}",
              flush=True)
        if resume_from:
            print(f"shardwise: resumed from {path} at step {step}", flush=True)
    bar = None
    if is_main and t.progress:
        import sys
        import threading

        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())
        bar = tqdm(total=t.steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                   mininterval=0.5 if sys.stderr.isatty() else 30.0)
    started, val = time.perf_counter(), (None, None, 0)
    while step < t.steps:
        t0 = time.perf_counter()
        idx = sampler.next()
        loss, correct = train_step(model, opt, x_tr[idx].to(device), y_tr[idx].to(device),
                                   o.grad_clip)
        sched.step()
        step += 1
        loss, correct = model.global_metrics(loss, correct, device)
        dt = time.perf_counter() - t0
        if not math.isfinite(loss):
            raise NonFiniteLossError(f"training loss is {loss} at step {step}: stopped "
                                     "(lower optimizer.lr)")
        history.append(loss)
        if step % t.log_every == 0 or step == t.steps:
            metrics.write({"kind": "train", "step": step, "loss": loss,
                           "acc": correct / t.global_batch_size, "lr": opt.param_groups[0]["lr"],
                           "step_s": dt, "images_per_s": t.global_batch_size / dt})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", img_s=f"{t.global_batch_size / dt:.0f}",
                            refresh=False)
        if t.eval_every and step % t.eval_every == 0 and step < t.steps:
            val = _log_eval(model, x_val, y_val, cfg, device, step, metrics, bar)
        if ck.every and step % ck.every == 0 and step < t.steps:
            save(cfg, model, opt, sched, sampler, step, history)
    if bar is not None:
        bar.close()
    val = _log_eval(model, x_val, y_val, cfg, device, step, metrics, None)
    x_te, y_te = load_split(cfg.data.path, "test")
    test_loss, test_acc, n_test = evaluate(model, x_te, y_te, t.global_batch_size, device)
    metrics.write({"kind": "test", "step": step, "test_loss": test_loss, "test_acc": test_acc})
    if ck.at_end:
        save(cfg, model, opt, sched, sampler, step, history)
    elapsed = time.perf_counter() - started
    if is_main and t.progress:
        png = plot(out_dir / "metrics.jsonl", out_dir / "loss.png",
                   f"CNN on Fashion-MNIST, {cfg.cnn.ranks} ranks, "
                   f"{','.join(model.plan.strategies)}")
        print(f"loss and accuracy curves: {png}", flush=True)
    return {"step": step, "loss": history[-1] if history else None, "val_loss": val[0],
            "val_acc": val[1], "test_acc": test_acc, "elapsed_s": elapsed,
            "summary": f"validation accuracy {100 * val[1]:.2f}%, test accuracy "
                       f"{100 * test_acc:.2f}% on {n_test:,} test images"}


def _log_eval(model, x, y, cfg, device, step, metrics, bar):
    loss, acc, n = evaluate(model, x, y, cfg.training.global_batch_size, device)
    metrics.write({"kind": "val", "step": step, "val_loss": loss, "val_acc": acc})
    if model.group.rank == 0 and cfg.training.progress:
        from tqdm import tqdm

        tqdm.write(f"step {step}: validation loss {loss:.4f}, accuracy {100 * acc:.2f}% "
                   f"({n:,} images)")
    return loss, acc, n
