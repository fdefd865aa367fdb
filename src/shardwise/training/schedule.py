"""The learning-rate schedule every application trains with: linear warm-up, then cosine
decay to ``optimizer.min_lr`` (as in GPT-2 / nanoGPT; Loshchilov & Hutter, SGDR,
arXiv:1608.03983, for the cosine)."""

from __future__ import annotations

import math

import torch

from shardwise.base.config import OptimizerConfig


def lr_lambda(step: int, warmup: int, total: int, lr: float, min_lr: float) -> float:
    """Multiplier of ``lr`` at ``step`` (0-based optimizer step): ``(step + 1) / (warmup + 1)``
    for the first ``warmup`` steps, then cosine from 1 down to ``min_lr / lr`` at ``total``
    (held there after it). ``lr`` 0 (a frozen run): 0."""
    if lr == 0:
        return 0.0
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return (min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))) / lr


def warmup_cosine(optimizer: torch.optim.Optimizer, o: OptimizerConfig,
                  total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` stepping ``lr_lambda`` with the ``[optimizer]``
    section's ``warmup_steps``, ``lr`` and ``min_lr`` over ``total`` (``training.steps``)
    steps. Its ``state_dict`` stores the step only (the lambda is rebuilt from the config)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, o.warmup_steps, total, o.lr, o.min_lr))
