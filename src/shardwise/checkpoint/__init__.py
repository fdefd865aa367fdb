"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), complete or invisible.

Layout of a checkpoint directory ``ROOT/step_000100/``:

- DCP files (``.metadata``, ``__*_*.distcp``) holding **tensors only**: the trainer's are
  layout-independent (``engine.state``: fp32 masters and AdamW moments as the
  single-process model's tensors, tp slices as DTensor chunks). DCP reads tensors with
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
``latest_checkpoint`` ignores. ``save_async`` does the writing, the checksums and the
rename in a background thread, in that order, so the same holds while training goes on.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException as DCPException

from shardwise import comm
from shardwise.base.errors import (
    USER_ERRNOS,
    CheckpointError,
    StorageError,
    os_error_in,
    storage_error,
)
from shardwise.base.files import temporary
from shardwise.checkpoint.integrity import (
    MANIFEST,
    IntegrityError,
    first_non_finite,
    read_manifest,
    verify,
    write_manifest,
)
from shardwise.checkpoint.reader import SafeReader, UnsafeCheckpointError
from shardwise.comm.check import group_device

__all__ = ["CheckpointError", "IntegrityError", "UnsafeCheckpointError", "MANIFEST", "META",
           "checkpoint_name", "complete_checkpoints", "latest_checkpoint", "find_resumable",
           "save", "save_async", "PendingSave", "load", "read_meta", "read_tensors", "tensor_names",
           "verify", "step_of"]

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
    final, tmp = _begin(Path(root), step, tensors, group)
    with _removed_on_failure(tmp, _nbytes(tensors)):
        _write(tensors, tmp, group)
        _barrier(group)
        if _rank() == 0:
            _commit(Path(root), final, tmp, step, meta, keep)
    _barrier(group)
    return final


def save_async(root: str | Path, step: int, tensors: dict[str, Any], meta: dict[str, Any],
               keep: int | None = None) -> "PendingSave":
    """``save`` whose writing goes on in a background thread; returns at once.

    Collective over the world. ``tensors`` must be a snapshot the caller no longer changes
    (``engine.state.logical_tensors`` returns fresh CPU copies). Before returning, the
    non-finite check runs and the temporary directory is made (both on the training's
    process group); the thread then runs ``dcp.save`` on a gloo group of its own (created
    once: two threads must not share a gloo group's collectives) and, on rank 0, writes
    ``meta.json`` and ``checksums.json`` and renames the directory into place. DCP's save
    returns only after every rank's files are written and fsynced and ``.metadata`` is
    written (its coordinator gathers every rank's write results first), so the rename,
    the commit point, comes after every byte of every rank. A crash before it leaves a
    ``.tmp`` directory, which no reader takes for a checkpoint.
    """
    root = Path(root)
    meta = json.loads(json.dumps(meta))  # a snapshot: the caller's lists go on growing
    final, tmp = _begin(root, step, tensors, None)
    group = _writer_group()

    def work() -> None:
        with _removed_on_failure(tmp, _nbytes(tensors)):
            _write(tensors, tmp, group)
            if _rank() == 0:
                _commit(root, final, tmp, step, meta, keep)

    return PendingSave(final, work)


class PendingSave:
    """A checkpoint being written by a background thread (``save_async``).

    ``path``: the directory it will have once complete; ``done()``; ``wait()`` joins the
    thread and raises ``CheckpointError`` (one line) if writing failed. The thread is a
    daemon: a process that exits first leaves only the ``.tmp`` directory behind.
    """

    def __init__(self, path: Path, work):
        self.path, self._error = path, None
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True,
                                        name=f"shardwise-checkpoint-{path.name}")
        self._thread.start()

    def _run(self, work) -> None:
        try:
            work()
        except BaseException as e:  # reported by wait(), in the training thread
            self._error = e

    def done(self) -> bool:
        """True once the background write has ended (successfully or not); never blocks."""
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until the background write ends; returns the checkpoint's path. Raises
        CheckpointError when the write failed."""
        self._thread.join()
        if isinstance(self._error, StorageError):  # a full disk: one line naming it, exit 2
            raise self._error
        if self._error is not None:
            raise CheckpointError(f"writing {self.path} in the background failed: "
                                  f"{type(self._error).__name__}: {self._error}") from None
        return self.path


_WRITER: list = [None, None]  # [the world it was made in, the gloo group]


def _writer_group():
    """A gloo group over the world for background writes (None without torch.distributed).
    Created on first use; every rank reaches it at the same save, so creation is collective."""
    if not dist.is_initialized():
        return None
    if _WRITER[0] is not dist.group.WORLD:  # first use, or a new world (a restarted gang)
        _WRITER[:] = [dist.group.WORLD, dist.new_group(backend="gloo")]
    return _WRITER[1]


@contextlib.contextmanager
def _removed_on_failure(tmp: Path, nbytes: int = 0):
    """Rank 0 removes ``tmp`` when the block raises (a failed save leaves no ``.tmp``); an
    ``OSError`` such as ENOSPC or EACCES, raised here or inside DCP, comes out as a
    ``StorageError`` naming ``tmp`` and the errno. torch's archive writer reports a full
    disk as a ``RuntimeError`` ("unexpected pos"): a failure while the file system has
    fewer than ``nbytes`` (this rank's tensors) free is taken for ENOSPC."""
    try:
        yield
    except BaseException as e:
        full = _free_bytes(tmp.parent) < nbytes  # measured before the .tmp gives space back
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, StorageError):
            raise
        os_err = os_error_in(e)
        if os_err is not None and os_err is not e and os_err.errno not in USER_ERRNOS:
            os_err = None  # an OSError met on the way (inside DCP): not the user's to fix
        if os_err is None and full and not isinstance(e, (KeyboardInterrupt, SystemExit)):
            os_err = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if os_err is not None:
            raise storage_error(os_err, f"checkpoint {tmp}", "the step's .tmp was removed; "
                                "the earlier checkpoints are kept") from e
        raise


def _free_bytes(path: Path) -> int:
    """Bytes free to this user on ``path``'s file system (a huge number if unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


def _nbytes(tree: Any) -> int:
    """Bytes of the tensors of a nested dict (a DTensor: its local shard)."""
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        return local.numel() * local.element_size()
    return 0


def _begin(root: Path, step: int, tensors: dict[str, Any], group) -> tuple[Path, Path]:
    """Refuse non-finite tensors (every rank), then rank 0 makes an empty ``step_N.tmp``."""
    _refuse_non_finite(tensors, step, group)
    final = root / checkpoint_name(step)
    tmp = temporary(final)
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        with _removed_on_failure(tmp):
            tmp.mkdir(parents=True, exist_ok=True)
    _barrier(group)
    return final, tmp


def _write(tensors: dict[str, Any], tmp: Path, group) -> None:
    with _single_process_ok():
        dcp.save(tensors, checkpoint_id=str(tmp), process_group=group)


def _commit(root: Path, final: Path, tmp: Path, step: int, meta: dict[str, Any],
            keep: int | None) -> None:
    """Rank 0, after every rank has written: meta, checksums, then the atomic rename."""
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


def read_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's ``meta.json``; raises ``CheckpointError`` naming the file if unreadable."""
    path = Path(path)
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / META}: not a readable checkpoint description ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path / META}: not a readable checkpoint description (a JSON "
                              f"{type(meta).__name__}, expected an object)")
    return meta


def _load_error(path: Path, e: Exception) -> CheckpointError:
    """One line for what ``dcp.load`` raised on tensors whose files pass their checksums:
    another model's checkpoint (a missing key, another size) or a data file that is no
    tensor archive. DCP's ``CheckpointException`` carries each rank's exception; the first
    is named."""
    import pickle

    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))  # (exception, traceback) or a wrapper
        first = first[0] if isinstance(first, tuple) and first else first
        e = getattr(first, "exc", first)
    if isinstance(e, pickle.UnpicklingError):  # torch.load(weights_only=True) refused it
        return CheckpointError(f"{path}: a data file holds something other than tensors "
                               "(refused by torch.load(weights_only=True); nothing in it ran)")
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    detail = lines[0][:300] if lines else "no detail"
    return CheckpointError(f"{path}: its tensors do not load into this model "
                           f"({type(e).__name__}: {detail})")


@contextlib.contextmanager
def _quiet_weights_only():
    """torch's weights-only unpickler warns about a foreign pickle protocol before refusing
    it; the refusal is reported in one line instead."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol",
                                category=UserWarning)
        yield


def tensor_names(path: str | Path) -> set[str]:
    """The flattened keys of every tensor a checkpoint holds (``"model.blocks.0..."``), from
    its ``.metadata`` alone (read with the restricted unpickler; the files' checksums are
    left to ``load``)."""
    path = Path(path)
    md = SafeReader(path, list(read_manifest(path)["files"])).read_metadata()
    return set(md.state_dict_metadata)


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
        try:
            with _quiet_weights_only():
                dcp.load(tensors, storage_reader=SafeReader(path, files), process_group=group)
        except CheckpointError:
            raise
        except (Exception, DCPException) as e:  # another model's checkpoint, a data file
            raise _load_error(path, e) from None  # no tensor archive (DCP's: a BaseException)
    return meta


def check_loadable(path: str | Path) -> dict[str, Any]:
    """Verify checksums, then read ``.metadata`` safely; return the meta. Reads no tensor."""
    path = Path(path)
    SafeReader(path, verify(path)).read_metadata()  # classes and file names both checked
    return read_meta(path)


def find_resumable(root: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under ``root`` whose files match their checksums.

    Returns ``(path or None, reasons)``: one line for each newer checkpoint skipped,
    ``damaged checkpoint ...`` or ``incomplete checkpoint PATH (no .metadata)``. A
    checkpoint whose metadata is unsafe raises ``UnsafeCheckpointError``: that is not an
    accident to step around.
    """
    skipped = []
    for path in reversed(_named_checkpoints(root)):
        lost = [f for f in (".metadata", META) if not (path / f).is_file()]
        if lost:  # renamed into place complete, so a file was deleted since: say so
            skipped.append(f"incomplete checkpoint {path} (no {' and no '.join(lost)})")
            continue
        try:
            check_loadable(path)
            return path, skipped
        except UnsafeCheckpointError:
            raise
        except (CheckpointError, OSError, ValueError) as e:  # damaged, unreadable
            skipped.append(f"damaged checkpoint {e}")
    return None, skipped


def _named_checkpoints(root: str | Path) -> list[Path]:
    """Every ``step_N`` directory under ``root`` (complete or not; no ``.tmp``), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), d) for d in root.iterdir()
             if (m := _NAME.match(d.name)) and d.is_dir()]
    return [d for _, d in sorted(found)]


def read_tensors(path: str | Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint whose flattened key starts with ``prefix`` (``"model."``),
    allocated from its metadata and loaded on the CPU, without a process group."""
    path = Path(path)
    files = verify(path)
    md = SafeReader(path, files).read_metadata()
    out = {k: torch.empty(v.size, dtype=v.properties.dtype)
           for k, v in md.state_dict_metadata.items() if k.startswith(prefix)}
    with _single_process_ok():
        try:
            with _quiet_weights_only():
                dcp.load(out, storage_reader=SafeReader(path, files), no_dist=True)
        except CheckpointError:
            raise
        except (Exception, DCPException) as e:  # a data file that is no tensor archive
            raise _load_error(path, e) from None
    return out


def _refuse_non_finite(tensors: dict[str, Any], step: int, group=None) -> None:
    """Raise ``CheckpointError`` on every rank if any rank holds a NaN or Inf (one round)."""
    bad = first_non_finite(tensors)
    if dist.is_initialized():
        flag = torch.tensor([0.0 if bad is None else 1.0], device=group_device(None))
        comm.all_reduce(flag, op="max", group=group)
        any_bad = flag.item() > 0
    else:
        any_bad = bad is not None
    if any_bad:
        where = f"{bad} on rank {_rank()}" if bad else "another rank's tensors"
        raise CheckpointError(f"refused to save step {step}: non-finite values in {where}; "
                              "the previous checkpoints are kept")
