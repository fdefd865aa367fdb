"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), complete or invisible.

Layout of a checkpoint directory ``ROOT/step_000100/``:

- DCP files (``.metadata``, ``__*_*.distcp``) holding **tensors only**: model parameters,
  optimizer moments, each rank's RNG state under its own key. DCP reads tensors with
  ``torch.load(weights_only=True)``; nothing else goes through pickle, because the
  default planner would unpickle non-tensor values with ``weights_only=False``.
- ``meta.json``: everything that is not a tensor (step, LR schedule, sampler position,
  optimizer hyper-parameters, tokenizer, config, layout), written by rank 0.

A save writes into ``step_000100.tmp/``; only after every rank has finished and
``meta.json`` is flushed does rank 0 rename it to ``step_000100/`` (an atomic rename on
POSIX). A crash mid-save leaves a ``.tmp`` directory that ``latest_checkpoint`` ignores.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

_NAME = re.compile(r"^step_(\d{6,})$")
META = "meta.json"


class CheckpointError(ValueError):
    """No usable checkpoint; the message names the directory and what was expected."""


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def _single_process_ok():
    """Without a process group DCP warns that it assumes one process: that is intended here."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step_{step:06d}"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (incomplete ``.tmp`` ones skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _NAME.match(d.name)
        if m and d.is_dir() and (d / META).is_file() and (d / ".metadata").is_file():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or ``None`` if there is none."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


def save(root: str | Path, step: int, tensors: dict[str, Any], meta: dict[str, Any],
         keep: int | None = None, group=None) -> Path:
    """Collectively save ``tensors`` (nested dict of tensors) and ``meta`` (JSON-able).

    Every rank of ``group`` (None: the world; it must hold global rank 0) calls this with the
    same ``step``. Returns the final directory. Older complete checkpoints beyond ``keep``
    are removed by rank 0.
    """
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / (final.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    _barrier(group)
    with _single_process_ok():
        dcp.save(tensors, checkpoint_id=str(tmp), process_group=group)
    _barrier(group)
    if _rank() == 0:
        with open(tmp / META, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)  # the commit point: before it, the checkpoint is invisible
        if keep is not None:
            for old in complete_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier(group)
    return final


def read_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's ``meta.json``; raises ``CheckpointError`` naming the file if unreadable."""
    path = Path(path)
    try:
        return json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / META}: not a readable checkpoint description ({e})") from None


def load(path: str | Path, tensors: dict[str, Any], group=None) -> dict[str, Any]:
    """Fill ``tensors`` (same structure as saved, or a part of it; preallocated) in place;
    return the meta. Collective over ``group`` (None: the world)."""
    path = Path(path)
    meta = read_meta(path)
    with _single_process_ok():
        dcp.load(tensors, checkpoint_id=str(path), process_group=group)
    return meta
