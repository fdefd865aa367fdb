"""Training the CNN with its per-layer plan: the per-rank entry point and its step,
evaluation and checkpoint, driven by the shared loop (``training.loop.run_loop``).

Selected by ``model.kind = "cnn"`` (the registry, ``shardwise.apps.registry``, hands over
here)::

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

from pathlib import Path

import torch
import torch.distributed as dist

from shardwise import checkpoint, comm
from shardwise.apps.cnn.app import cnn_config
from shardwise.apps.cnn.chooser import format_plan, resolve
from shardwise.apps.cnn.hybrid import HybridCNN
from shardwise.apps.cnn.layout import BATCH, my_rows
from shardwise.base.config import Config
from shardwise.base.files import save_figure
from shardwise.base.topology import Topology, init_process_groups
from shardwise.base.words import count
from shardwise.data.idx import load_split
from shardwise.models.cnn import CNN
from shardwise.parallel.tensor_parallel import (
    RankGroup,
    gather_tensor,
    shard_tensor,
)
from shardwise.training.console import status
from shardwise.training.loop import Cadence, TrainTask, run_loop
from shardwise.training.metrics import MetricsLog, read_metrics
from shardwise.training.schedule import warmup_cosine


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
        """The next global batch's indices, shape ``(batch,)`` int64; a new permutation starts each
        epoch."""
        if self.index == self.per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        perm = torch.randperm(self.n, generator=g)
        self.index += 1
        return perm[(self.index - 1) * self.batch:self.index * self.batch]

    def state_dict(self) -> dict:
        """The sampler's position: epoch and batch index within it."""
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, s: dict) -> None:
        """Continue from ``state_dict()``'s position."""
        self.epoch, self.index = int(s["epoch"]), int(s["index"])


def build(cfg: Config, group: RankGroup, device: torch.device):
    """The hybrid model for ``cfg`` on this rank (full CNN from ``training.seed``, then split)."""
    torch.manual_seed(cfg.training.seed)
    full = CNN(cnn_config(cfg.cnn))
    plan = resolve(cfg.cnn.plan, full.specs(), cfg.training.global_batch_size, cfg.cnn.ranks,
                   flops_per_s=cfg.cnn.flops_per_s)
    return HybridCNN(full, plan, group).to(device)


def make_optimizer(cfg: Config, model: HybridCNN) -> torch.optim.Optimizer:
    """The optimizer ``cnn.optimizer`` names over ``model``'s parameters: SGD with ``cnn.momentum``,
    or AdamW with the ``[optimizer]`` betas; lr and weight decay from ``[optimizer]``."""
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
        model.clip_grad_norm_(grad_clip)
    opt.step()
    return loss, correct


@torch.no_grad()
def evaluate(model: HybridCNN, x: torch.Tensor, y: torch.Tensor, batch: int,
             device) -> tuple[float, float, int]:
    """(mean loss, accuracy, samples) over ``x, y`` in chunks of ``batch`` (the last chunk
    trimmed to a multiple of the rank count)."""
    import torch.nn.functional as F

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
                v = gather_tensor(v, p.tp_dim, model.group)
            st[k] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(float(v))
        out[name] = st
    for name, shape, _ in model.placed_params():  # a placed branch's: from its owner
        mine = out.get(name, {})
        out[name] = {k: model.collect_placed(mine.get(k), () if k == "step" else shape)
                     for k in _state_keys(opt)}
    return out


def _state_keys(opt) -> tuple[str, ...]:
    """The per-parameter state ``opt`` keeps (SGD with momentum, or AdamW)."""
    return ("momentum_buffer",) if isinstance(opt, torch.optim.SGD) else ("step", "exp_avg",
                                                                           "exp_avg_sq")


def save(cfg: Config, model, opt, sched, sampler, step: int, history: list) -> Path:
    """Save a checkpoint of step ``step``: the full model, the optimizer, scheduler and sampler
    states, the history and the plan. Returns its directory."""
    tensors = {"model": model.full_state(), "optimizer": _opt_state(model, opt)}
    meta = {"kind": "cnn", "step": step, "sampler": sampler.state_dict(),
            "scheduler": sched.state_dict(), "history": history, "config": cfg.model_dump(),
            "plan": model.plan.strategies, "layout": {"ranks": cfg.cnn.ranks}}
    return checkpoint.save(cfg.checkpoint_dir, step, tensors, meta, keep=cfg.checkpoint.keep)


def resume(path: Path, model: HybridCNN, opt, sched, sampler) -> dict:
    """Load ``path`` into this rank's shards (any plan or rank count saved it)."""
    meta = checkpoint.read_meta(path)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in CNN(model.cfg).named_parameters()}
    keys = _state_keys(opt)
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
    try:
        return save_figure(fig, png)
    finally:
        plt.close(fig)


# ------------------------------------------------------------------ the task of the loop

class CNNTask(TrainTask):
    """One rank of the CNN's training, as ``run_loop`` drives it: a step on the global batch
    (losses read every step: the plan's collectives already synchronise), validation loss and
    accuracy, checkpoints of the unsharded state. Throughput in images; MFU from the plan's
    forward FLOPs per image (x3 for training) over ``cnn.ranks`` ranks."""

    def __init__(self, cfg: Config, topo: Topology, device: torch.device):
        t = cfg.training
        self.cfg, self.device, self.is_main = cfg, device, topo.rank == 0
        group = RankGroup(group=topo.groups.dp, size=topo.dp, rank=topo.dp_rank,
                         all_reduce="ring", gather="ring")
        x_all, y_all = load_split(cfg.data.path, "train")
        n_val = max(1, int(len(x_all) * cfg.data.val_fraction))
        self.x_tr, self.y_tr = x_all[:-n_val], y_all[:-n_val]
        self.x_val, self.y_val = x_all[-n_val:], y_all[-n_val:]
        self.model = build(cfg, group, device)
        self.opt = make_optimizer(cfg, self.model)
        self.sched = warmup_cosine(self.opt, cfg.optimizer, t.steps)
        self.sampler = BatchSampler(len(self.x_tr), t.global_batch_size, t.seed)
        self.step, self.history = 0, []
        self.cadence = Cadence.from_config(cfg)
        self.sample_unit, self.samples_per_step = "images", t.global_batch_size
        self.flops_per_sample = 3.0 * sum(s.flops for s in self.model.plan.specs)
        self.world_size = cfg.cnn.ranks

    def train_step(self, sync: bool = True) -> dict:
        """One optimizer step on the next global batch; returns ``loss`` and ``acc`` over every rank
        (``sync`` is ignored: the metrics are already global)."""
        t = self.cfg.training
        idx = self.sampler.next()
        loss, correct = train_step(self.model, self.opt, self.x_tr[idx].to(self.device),
                                   self.y_tr[idx].to(self.device), self.cfg.optimizer.grad_clip)
        self.sched.step()
        self.step += 1
        loss, correct = self.model.global_metrics(loss, correct, self.device)
        self.record_loss(loss)
        info = {"loss": loss, "acc": correct / t.global_batch_size,
                "lr": self.opt.param_groups[0]["lr"]}
        return self.settle(info) if sync else info

    def evaluate(self) -> dict:
        """``val_loss``, ``val_acc`` (0..1) and ``val_images`` over the validation set."""
        loss, acc, n = evaluate(self.model, self.x_val, self.y_val,
                                self.cfg.training.global_batch_size, self.device)
        return {"val_loss": loss, "val_acc": acc, "val_images": n}

    def eval_line(self, row: dict) -> str:
        """The progress line of a validation row (loss and accuracy in %)."""
        return (f"step {row['step']}: validation loss {row['val_loss']:.4f}, accuracy "
                f"{100 * row['val_acc']:.2f}% ({row['val_images']:,} images)")

    def save_checkpoint(self) -> Path:
        """Save this step's checkpoint (see ``save``); returns its directory."""
        return save(self.cfg, self.model, self.opt, self.sched, self.sampler, self.step,
                    self.history)

    def draw(self) -> Path | None:
        """Rank 0 of a run with ``training.progress`` (a CLI run): (re)draw ``loss.png`` (loss
        and accuracy) from ``metrics.jsonl``; None otherwise."""
        out_dir = Path(self.cfg.training.out_dir)
        if not (self.cfg.training.progress and (out_dir / "metrics.jsonl").is_file()):
            return None
        return plot(out_dir / "metrics.jsonl", out_dir / "loss.png",
                    f"CNN on Fashion-MNIST, {self.cfg.cnn.ranks} ranks, "
                    f"{','.join(self.model.plan.strategies)}")

    def resume(self, path: Path) -> None:
        """Load the checkpoint at ``path`` into the model, optimizer, scheduler and sampler;
        continue from its step."""
        meta = resume(path, self.model, self.opt, self.sched, self.sampler)
        self.step, self.history = int(meta["step"]), list(meta["history"])


def train_rank(cfg_dict: dict, device: torch.device | None = None,
               resume_from: bool | str = False) -> dict:
    """Entry point of every rank (``torch.distributed`` is up with ``cnn.ranks`` ranks).
    ``resume_from``: a checkpoint path, ``True`` for the latest of ``checkpoint_dir``, or
    ``False``. Returns ``run_loop``'s summary with ``val_acc`` and ``test_acc`` (fractions)."""
    cfg = Config.from_dict(cfg_dict)
    t = cfg.training
    comm.configure(timeout_s=cfg.parallel.timeout_s)
    topo = init_process_groups(Topology.build(dp=cfg.cnn.ranks, rank=dist.get_rank(),
                                              world_size=dist.get_world_size()))
    device = device or torch.device("cpu")
    task = CNNTask(cfg, topo, device)
    if resume_from:
        path = (Path(resume_from) if isinstance(resume_from, str)
                else checkpoint.latest_checkpoint(cfg.checkpoint_dir))
        task.resume(path)
    if task.is_main:
        n = sum(s.params for s in task.model.plan.specs)
        status(f"shardwise: CNN {n / 1e6:.2f}M parameters, {len(task.x_tr):,} train / "
               f"{len(task.x_val):,} validation images, batch {t.global_batch_size}, "
               f"{count(cfg.cnn.ranks, 'rank')}, {count(torch.get_num_threads(), 'thread')} per "
               f"rank; plan:\n"
               f"{format_plan(task.model.plan)}")
        if resume_from:
            status(f"shardwise: resumed from {path} at step {task.step}")
    out = run_loop(task)
    x_te, y_te = load_split(cfg.data.path, "test")
    test_loss, test_acc, n_test = evaluate(task.model, x_te, y_te, t.global_batch_size, device)
    MetricsLog(Path(t.out_dir) / "metrics.jsonl", enabled=task.is_main).write(
        {"kind": "test", "step": task.step, "test_loss": test_loss, "test_acc": test_acc})
    if task.is_main and t.progress:
        print(f"loss and accuracy curves: {task.draw()}", flush=True)
    return {**out, "test_acc": test_acc, "test_images": n_test}


def summary(result: dict) -> str:
    """The end of the closing line: final train loss, validation and test accuracy."""
    return (f"final train loss {result['loss']:.4f}, validation accuracy "
            f"{100 * result['val_acc']:.2f}%, test accuracy {100 * result['test_acc']:.2f}% "
            f"on {result['test_images']:,} test images")
