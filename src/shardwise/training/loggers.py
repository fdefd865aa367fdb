"""Where the loop's metric rows go: ``metrics.jsonl`` always, TensorBoard and Weights &
Biases when asked (``training.tensorboard``, ``training.wandb``), on rank 0 only.

Every number of a row becomes a scalar named ``train/<key>`` or ``val/<key>`` at the row's
step (loss, lr, grad_norm, tokens_per_s, step_s, flops_per_s, mfu, loss_scale, val_loss;
lists and None are skipped), and each train row adds memory high-water marks:
``memory/max_rss_mib`` (``getrusage``: the peak resident set of rank 0's process, since it
started) and, on CUDA, ``memory/peak_allocated_mib_max`` and ``memory/peak_reserved_mib_max``
(the largest over the ranks of the row's per-rank lists: the window's peaks,
``training.memory``).
TensorBoard's event files are written by ``torch.utils.tensorboard.SummaryWriter`` under
``out_dir/tensorboard`` (``tensorboard --logdir OUT_DIR/tensorboard``); W&B's run lives in
``out_dir/wandb`` (``wandb sync`` uploads an offline one).
"""

from __future__ import annotations

import importlib.util
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from shardwise.base.config import Config, ConfigError
from shardwise.training.memory import KEYS as MEMORY_KEYS
from shardwise.training.metrics import MetricsLog


def check_loggers(cfg: Config) -> None:
    """At the door: the packages ``training.tensorboard`` / ``training.wandb`` need are
    installed; ``ConfigError`` (one line, with the pip command) otherwise. Imports nothing."""
    t = cfg.training
    if t.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("training.tensorboard=true: the tensorboard package is not installed "
                          "(pip install tensorboard); torch.utils.tensorboard writes through it")
    if t.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"training.wandb={t.wandb}: the wandb package is not installed "
                          "(pip install wandb)")


def _memory_mib(row: dict[str, Any]) -> dict[str, float]:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out = {"memory/max_rss_mib": rss / (2**20 if sys.platform == "darwin" else 2**10)}
    for key in MEMORY_KEYS:  # CUDA: per-rank lists (training.memory); the busiest rank's
        if row.get(key):
            out[f"memory/{key}_max"] = float(max(row[key]))
    return out


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    prefix = "val" if row.get("kind") == "val" else "train"
    return {f"{prefix}/{k}": float(v) for k, v in row.items()
            if k not in ("kind", "step") and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


class RunLog:
    """The loop's metric sinks (see the module docstring). ``write(row)`` sends one row to
    each; ``close()`` flushes them. Disabled (``enabled=False``: ranks other than 0) it does
    nothing and imports nothing."""

    def __init__(self, cfg: Config, enabled: bool = True,
                 device: torch.device = torch.device("cpu")):
        t = cfg.training
        self.device = device
        self.jsonl = MetricsLog(Path(t.out_dir) / "metrics.jsonl", enabled=enabled)
        self.tensorboard = self.wandb = None
        if enabled and t.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(Path(t.out_dir) / "tensorboard"))
        if enabled and t.wandb:
            import wandb

            self.wandb = wandb.init(project="shardwise", dir=str(Path(t.out_dir)), mode=t.wandb,
                                    config=cfg.model_dump(), name=Path(t.out_dir).name)

    def write(self, row: dict[str, Any]) -> None:
        """Append ``row`` to metrics.jsonl, and its numbers (plus memory marks on train rows) to
        TensorBoard and W&B when they are on, at the row's step."""
        self.jsonl.write(row)
        if self.tensorboard is None and self.wandb is None:
            return
        scalars = _scalars(row)
        if row.get("kind") == "train":
            scalars.update(_memory_mib(row))
        step = int(row.get("step", 0))
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close TensorBoard's writer and finish the W&B run (metrics.jsonl needs no
        closing)."""
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
