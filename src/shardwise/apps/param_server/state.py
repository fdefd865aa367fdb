"""Server checkpoints: each server's keys and their optimizer state, through the project's
DCP checkpoints (``shardwise.checkpoint``), saved collectively by the servers only.

Tensors are stored per key (``params/<name>``, ``optim/<name>/<state>``): a key lives
whole on one server, so a job restarted with another number of servers loads its own keys
from the same files (DCP matches by name). ``meta.json`` (written by server 0) holds the
applied clock, the layout and the consistency; workers read it to resume at that clock.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardwise import checkpoint
from shardwise.apps.param_server.optim import RangeOptimizer

_ADAMW = ("step", "exp_avg", "exp_avg_sq")
_SGD = ("momentum_buffer",)


def state_tensors(rng: RangeOptimizer, kind: str, allocate: bool = False) -> dict:
    """The DCP state of a server's range: its key tensors and optimizer state per key.
    ``allocate``: create empty optimizer state first (to load into)."""
    params, optim = {}, {}
    for k, t in zip(rng.keys, rng.tensors):
        params[k.name] = t
        st = rng.optimizer.state[t]
        if allocate:
            if kind == "adamw":
                st.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(t),
                          exp_avg_sq=torch.zeros_like(t))
            elif rng.optimizer.defaults["momentum"] > 0:
                st.update(momentum_buffer=torch.zeros_like(t))
        optim[k.name] = {n: st[n] for n in (_ADAMW if kind == "adamw" else _SGD) if n in st}
    return {"params": params, "optim": optim}


def save(root: str | Path, applied: int, rng: RangeOptimizer, kind: str, meta: dict,
         keep: int, group) -> Path:
    """Collective over the servers' ``group``: write checkpoint ``step_{applied}``."""
    return checkpoint.save(root, applied, state_tensors(rng, kind), meta | {"applied": applied},
                           keep=keep, group=group)


def check_resumable(path: str | Path, cfg) -> None:
    """``CheckpointError`` (one line) unless ``path`` is a parameter-server checkpoint of the
    same optimizer (any S and W may resume it)."""
    meta = checkpoint.read_meta(path)
    if "applied" not in meta:
        raise checkpoint.CheckpointError(f"--resume: {path} is not a parameter-server "
                                         "checkpoint (parallel.mode=ps)")
    if meta.get("optimizer") != cfg.ps.optimizer:
        raise checkpoint.CheckpointError(f"--resume: {path} was saved with ps.optimizer="
                                         f"{meta.get('optimizer')}, this run has "
                                         f"{cfg.ps.optimizer}")


def load(path: str | Path, rng: RangeOptimizer, kind: str, group) -> dict:
    """Collective over the servers' ``group``: fill this server's keys and optimizer state
    from checkpoint ``path``; returns its meta. ``CheckpointError`` if the optimizer differs."""
    meta = checkpoint.read_meta(path)
    if meta.get("optimizer") != kind:
        raise checkpoint.CheckpointError(f"{path}: saved with ps.optimizer="
                                         f"{meta.get('optimizer')}, this run has {kind}")
    checkpoint.load(path, state_tensors(rng, kind, allocate=True), group=group)
    return meta
