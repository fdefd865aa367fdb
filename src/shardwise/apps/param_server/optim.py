"""The update a server applies to its key range: torch's AdamW or SGD with momentum.

Each key (parameter tensor) of the range is one tensor of the optimizer, so the update is
exactly what ``torch.optim`` does to the whole model in one process: both optimizers are
elementwise, and weight decay goes to matrices only (``dim >= 2``), as in the trainer. The
learning rate of a step is ``lr * lr_lambda(clock)``, the shared warm-up + cosine
schedule (``training.schedule``) indexed by the clock the gradient belongs to.
"""

from __future__ import annotations

import torch

from shardwise.apps.param_server.partition import Key
from shardwise.training.schedule import lr_lambda


def lr_at(step: int, o, total: int) -> float:
    """``o.lr * lr_lambda(step)`` (``o``: the ``[optimizer]`` config section)."""
    return o.lr * lr_lambda(step, o.warmup_steps, total, o.lr, o.min_lr)


def param_groups(tensors: list[torch.Tensor], weight_decay: float) -> list[dict]:
    """Decay on matrices (embeddings, linear weights), none on vectors; empty groups kept
    out so torch's optimizer sees what the trainer's sees."""
    decay = [t for t in tensors if t.dim() >= 2]
    rest = [t for t in tensors if t.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def make_optimizer(kind: str, tensors: list[torch.Tensor], o, momentum: float = 0.9):
    """``torch.optim.AdamW`` (betas and decay from ``o``) or ``torch.optim.SGD`` with
    ``momentum``; ``foreach=False`` like the trainer, so the arithmetic is the same."""
    groups = param_groups(tensors, o.weight_decay)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), foreach=False)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=momentum, foreach=False)
    raise ValueError(f"optimizer must be adamw or sgd, got {kind!r}")


class RangeOptimizer:
    """The weights of one server's keys and their optimizer.

    ``flat`` (shape ``(hi - lo,)``, fp32) holds the range; each key is a view of it, so the
    optimizer updates ``flat`` in place and a pull sends ``flat`` as it is.
    """

    def __init__(self, keys: tuple[Key, ...], values: torch.Tensor, kind: str, o, total: int,
                 momentum: float = 0.9):
        self.keys, self.o, self.total = keys, o, total
        base = keys[0].lo
        self.flat = values.detach().clone()
        self.tensors = [self.flat[k.lo - base:k.hi - base].view(k.shape) for k in keys]
        self.optimizer = make_optimizer(kind, self.tensors, o, momentum)
        self.steps = 0

    def apply(self, grad: torch.Tensor, clock: int) -> None:
        """One optimizer step with the flat gradient ``grad`` (shape of ``flat``) at the
        learning rate of ``clock``."""
        base = self.keys[0].lo
        for t, k in zip(self.tensors, self.keys):
            t.grad = grad[k.lo - base:k.hi - base].view(k.shape)
        lr = lr_at(clock, self.o, self.total)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        for t in self.tensors:
            t.grad = None
        self.steps += 1
