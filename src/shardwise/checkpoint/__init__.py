"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), complete or invisible.

Layout of a checkpoint directory ``ROOT/step_000100/``:

- DCP files (``.metadata``, ``__*_*.distcp``) holding **tensors only**: model parameters,
  optimizer moments, each rank's RNG state under its own key. DCP reads tensors with
  ``torch.load(weights_only=True)``; no other value is saved, because the default planner
  would unpickle non-tensor values with ``weights_only=False``.
- ``meta.json``: everything that is not a tensor (step, LR schedule, sampler position,
  optimizer hyper-parameters, tokenizer, config, layout), written by rank 0.
- ``checksums.json``: size and SHA-256 of every file above (``integrity``).

Loading never runs code from the checkpoint: ``.metadata`` is unpickled by
``reader.MetadataUnpickler``, which admits only DCP's metadata classes, and every file is
checked against ``checksums.json`` first. A save refuses tensors holding NaN or Inf, on
every rank at once, so a diverged run never overwrites good checkpoints.

A save writes into ``step_000100.tmp/``; only after every rank has finished and
``meta.json`` and ``checksums.json`` are flushed does rank 0 rename it to ``step_000100/``
(an atomic rename on POSIX). A crash mid-save leaves a ``.tmp`` directory that
``latest_checkpoint`` ignores.
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

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shardwise.checkpoint.integrity import (MANIFEST, IntegrityError, first_non_finite,
                                            read_manifest, verify, write_manifest)
from shardwise.checkpoint.reader import SafeReader, UnsafeCheckpointError
from shardwise.errors import CheckpointError

__all__ = ["CheckpointError", "IntegrityError", "UnsafeCheckpointError", "MANIFEST", "META",
           "checkpoint_name", "complete_checkpoints", "latest_checkpoint", "find_resumable",
           "save", "load", "read_meta", "read_tensors", "verify", "step_of"]

_NAME = re.compile(r"^step_(\d{6,})$")
META = "meta.json"


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


def step_of(path: str | Path) -> int:
    """The step in a checkpoint directory's name (``step_000100`` -> 100)."""
    m = _NAME.match(Path(path).name)
    if not m:
        raise CheckpointError(f"{path}: not a checkpoint directory name (step_NNNNNN)")
    return int(m.group(1))


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

    Every rank of ``group`` (None: the world; it must hold global rank 0) calls this with
    the same ``step``. Returns the final directory. Older
    complete checkpoints beyond ``keep`` (at this step or before it) are removed by rank 0.
    Raises ``CheckpointError`` on every rank, writing nothing, if any rank's tensors hold
    NaN or Inf.
    """
    root = Path(root)
    _refuse_non_finite(tensors, step, group)
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
        write_manifest(tmp)
        if final.exists():  # only a damaged or abandoned checkpoint of this step can be here
            shutil.rmtree(final)
        os.replace(tmp, final)  # the commit point: before it, the checkpoint is invisible
        if keep is not None:
            done = [c for c in complete_checkpoints(root) if step_of(c) <= step]
            for old in done[:-keep]:
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


def load(path: str | Path, tensors: dict[str, Any], verified: bool = False,
         group=None) -> dict[str, Any]:
    """Fill ``tensors`` (same structure as saved, or a part of it; preallocated) in place;
    return the meta. Collective over ``group`` (None: the world).

    Checks every file against ``checksums.json`` first (skipped when ``verified``, i.e.
    ``find_resumable`` has just done it) and reads ``.metadata`` with the restricted
    unpickler. Raises ``IntegrityError`` (damaged) or ``UnsafeCheckpointError`` (crafted),
    both ``ValueError`` with a one-line message.
    """
    path = Path(path)
    files = verify(path) if not verified else list(read_manifest(path)["files"])
    meta = read_meta(path)
    # refuse here, in one line, what SafeReader would refuse inside DCP's collective wrapper
    SafeReader(path, files).read_metadata()
    with _single_process_ok():
        dcp.load(tensors, storage_reader=SafeReader(path, files), process_group=group)
    return meta


def check_loadable(path: str | Path) -> dict[str, Any]:
    """Verify checksums, then read ``.metadata`` safely; return the meta. Reads no tensor."""
    path = Path(path)
    SafeReader(path, verify(path)).read_metadata()  # classes and file names both checked
    return read_meta(path)


def find_resumable(root: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under ``root`` whose files match their checksums.

    Returns ``(path or None, reasons)``: one line for each newer checkpoint skipped as
    damaged. A checkpoint whose metadata is unsafe raises ``UnsafeCheckpointError``: that
    is not an accident to step around.
    """
    skipped = []
    for path in reversed(complete_checkpoints(root)):
        try:
            check_loadable(path)
            return path, skipped
        except UnsafeCheckpointError:
            raise
        except (CheckpointError, OSError, ValueError) as e:  # damaged, unreadable
            skipped.append(str(e))
    return None, skipped


def read_tensors(path: str | Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint whose flattened key starts with ``prefix`` (``"model."``),
    allocated from its metadata and loaded on the CPU, without a process group."""
    path = Path(path)
    files = verify(path)
    md = SafeReader(path, files).read_metadata()
    out = {k: torch.empty(v.size, dtype=v.properties.dtype)
           for k, v in md.state_dict_metadata.items() if k.startswith(prefix)}
    with _single_process_ok():
        dcp.load(out, storage_reader=SafeReader(path, files), no_dist=True)
    return out


def _refuse_non_finite(tensors: dict[str, Any], step: int, group=None) -> None:
    """Raise ``CheckpointError`` on every rank if any rank holds a NaN or Inf (one round)."""
    bad = first_non_finite(tensors)
    if dist.is_initialized():
        from shardwise import comm

        from shardwise.comm.check import group_device

        flag = torch.tensor([0.0 if bad is None else 1.0], device=group_device(None))
        comm.all_reduce(flag, op="max", group=group)
        any_bad = flag.item() > 0
    else:
        any_bad = bad is not None
    if any_bad:
        where = f"{bad} on rank {_rank()}" if bad else "another rank's tensors"
        raise CheckpointError(f"refused to save step {step}: non-finite values in {where}; "
                              "the previous checkpoints are kept")
