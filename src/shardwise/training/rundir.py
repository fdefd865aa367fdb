"""A run directory: one live run at a time, resume by default, no checkpoint deleted.

``prepare(cfg, mode)`` runs in the launcher before any rank starts (under torchrun, in
every rank, with only rank 0 taking the lock and touching files) and returns the
checkpoint to resume from:

- the directories must be writable (``training.out_dir``, ``checkpoint.dir``);
- ``out_dir/.shardwise.lock`` is held with ``flock`` for the launcher's lifetime, so a
  second live run on the same directory is refused; the kernel drops the lock when the
  holder dies, so a killed run never leaves a stale lock;
- ``mode="auto"`` (the default) resumes from the newest checkpoint whose checksums match,
  stepping over damaged ones with one line each; ``"resume"`` (``--resume``) also requires
  one; ``"fresh"`` (``--fresh``) renames the checkpoint directory and ``metrics.jsonl``
  aside (``*.before-YYYYmmdd-HHMMSS``) and starts at step 0;
- ``metrics.jsonl`` keeps only the rows up to the resumed step, so the resumed run
  appends without duplicates;
- once the checks pass, what a run that died while writing left (``step_N.tmp``,
  ``metrics.jsonl.tmp``) is removed: the lock proves its writer dead (``clean_stale``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardwise import checkpoint
from shardwise.base.errors import CheckpointError
from shardwise.base.files import temporary
from shardwise.training.metrics import truncate_metrics

LOCK = ".shardwise.lock"
CHECKPOINT_FORMAT = 2  # engine.state.FORMAT (not imported: the launcher builds no engine)
# the [model] fields that fix a checkpoint's tensors: resume and generate refuse another value
MODEL_SHAPE_FIELDS = ("kind", "n_layer", "n_head", "n_embd", "block_size", "bias",
                      "tie_weights", "n_kv_heads", "ffn_hidden", "multiple_of", "k_bias",
                      "activation")
_CNN_FIELDS = ("channels", "hidden", "kernel")  # model.kind = "cnn" (issue 16)


class RunDirError(ValueError):
    """The run directory cannot be used; one line naming the field or path."""


@dataclass
class RunPlan:
    """What ``prepare`` decided: the checkpoint to resume from and the lines to print."""

    resume_from: Path | None = None
    notes: list[str] = field(default_factory=list)
    lock: object | None = None  # the open lock file; keep it referenced while the run lives


def check_writable(path: Path, name: str) -> None:
    """Create ``path`` if needed and write a probe file there; ``RunDirError`` naming ``name``."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-"):
            pass
    except OSError as e:
        raise RunDirError(f"{name}: cannot write to {str(path)!r} "
                          f"({e.strerror or type(e).__name__})") from None


def acquire_lock(out_dir: Path):
    """Hold ``out_dir/.shardwise.lock`` exclusively; ``RunDirError`` if a live run holds it."""
    path = out_dir / LOCK
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise RunDirError(f"training.out_dir {str(out_dir)!r} is in use by a live run "
                          f"(pid {holder}); wait for it to end or choose another out_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def move_aside(cfg) -> list[str]:
    """Rename the checkpoint directory and ``metrics.jsonl`` to ``*.before-<time>``; return
    one line per moved path. Nothing is deleted."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    ck = cfg.checkpoint_dir
    if ck.is_dir() and any(ck.iterdir()):
        dest = ck.with_name(f"{ck.name}.before-{stamp}")
        ck.rename(dest)
        moved.append(f"{ck} -> {dest}")
    metrics = Path(cfg.training.out_dir) / "metrics.jsonl"
    if metrics.is_file():
        dest = metrics.with_name(f"metrics.before-{stamp}.jsonl")
        metrics.rename(dest)
        moved.append(f"{metrics} -> {dest}")
    return moved


def check_compatible(cfg, path: Path, meta: dict) -> None:
    """``RunDirError`` naming the first model field or step count that makes resuming
    ``path`` impossible under ``cfg``."""
    saved = meta.get("config", {}).get("model", {})
    lm = saved.get("kind", "gpt") != "cnn"  # the CNN's checkpoints have their own layout
    if lm and "history" in meta and meta.get("format") != CHECKPOINT_FORMAT:  # older trainer
        raise RunDirError(f"cannot resume {path}: written by an older shardwise (checkpoint "
                          f"format {meta.get('format', 1)}, this one reads "
                          f"{CHECKPOINT_FORMAT}); --fresh starts over (the old checkpoints "
                          "are kept)")
    for name in MODEL_SHAPE_FIELDS:
        ours = getattr(cfg.model, name, None)  # None: not a field of this model kind
        if name in saved and ours is not None and saved[name] != ours:
            raise RunDirError(f"cannot resume {path}: model.{name}={saved[name]!r} there, "
                              f"{ours!r} here; --fresh starts over (the old checkpoints are kept)")
    saved_cnn = meta.get("config", {}).get("cnn", {}) if saved.get("kind") == "cnn" else {}
    for name in _CNN_FIELDS:
        ours = getattr(cfg.cnn, name)
        if name in saved_cnn and saved_cnn[name] != ours:
            raise RunDirError(f"cannot resume {path}: cnn.{name}={saved_cnn[name]!r} there, "
                              f"{ours!r} here; --fresh starts over (the old checkpoints are kept)")
    if cfg.model.vocab_size and saved.get("vocab_size") not in (0, None, cfg.model.vocab_size):
        raise RunDirError(f"cannot resume {path}: model.vocab_size={saved['vocab_size']} there, "
                          f"{cfg.model.vocab_size} here")
    saved_data = meta.get("config", {}).get("data", {}).get("path")
    if "config" in meta and _resolved(saved_data) != _resolved(cfg.data.path):  # the tokenizer comes from there
        raise RunDirError(f"cannot resume {path}: data.path={saved_data!r} there, "
                          f"{cfg.data.path!r} here; --fresh starts over (the old checkpoints "
                          "are kept)")
    sampler = meta.get("sampler") if lm else None  # the data order: the sampler refuses
    for name, key in (("global_batch_size", "global_batch_size"), ("seed", "seed")):
        ours = getattr(cfg.training, name)
        if isinstance(sampler, dict) and key in sampler and sampler[key] != ours:
            raise RunDirError(f"cannot resume {path}: training.{name}={sampler[key]!r} there, "
                              f"{ours!r} here (the data order follows it); --fresh starts "
                              "over (the old checkpoints are kept)")
    step = saved_step(meta)
    if cfg.training.steps < step:
        raise RunDirError(f"training.steps={cfg.training.steps} is below step {step} of the "
                          f"checkpoint {path}; give more steps or --fresh")


def saved_step(meta: dict) -> int:
    """The step a checkpoint was taken at: ``step`` (trainer), ``applied`` clocks (servers)."""
    return int(meta.get("step", meta.get("applied", 0)))


def _resolved(path: str | None) -> str | None:
    return None if path is None else str(Path(path).expanduser().resolve())


def prepare(cfg, mode: str = "auto", is_rank0: bool = True, restart: bool = False,
            lock: bool = True) -> RunPlan:
    """Check, lock and set up the run directory; choose the checkpoint (see module doc).

    ``restart``: a gang restarted after a failure always resumes (``--fresh`` applied to
    the first launch only). ``lock``: take the lock (rank 0 only; a launcher restarting
    its ranks already holds it). Raises ``RunDirError`` or ``CheckpointError`` (one line).
    """
    out_dir, ck = Path(cfg.training.out_dir), cfg.checkpoint_dir
    created = _missing_dirs(out_dir) + _missing_dirs(ck)  # removed again if refused
    new_lock = not (out_dir / LOCK).exists()
    try:
        return _prepare(cfg, out_dir, ck, mode, is_rank0, restart, lock)
    except BaseException:  # bad input leaves no directory or lock file of ours behind
        if new_lock and is_rank0 and lock:
            with contextlib.suppress(OSError):
                (out_dir / LOCK).unlink(missing_ok=True)
        for d in sorted(set(created), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                (d / LOCK).unlink(missing_ok=True)
                d.rmdir()  # only when empty: nothing but what this call made
        raise


def clean_stale(out_dir: Path, ck: Path) -> list[str]:
    """Remove what a run that died while writing left: ``step_N.tmp`` checkpoint directories
    and ``metrics.jsonl.tmp``; one line per removed path. Called only by the holder of
    ``out_dir``'s lock (or the launcher restarting its own ranks, all ended), which proves no
    live writer; a ``checkpoint.dir`` outside ``out_dir`` is left alone (another run's lock
    may cover it)."""
    stale = [temporary(out_dir / "metrics.jsonl")]
    if ck.resolve().is_relative_to(out_dir.resolve()):
        with contextlib.suppress(OSError):  # no checkpoint directory (yet), or unreadable
            stale += sorted(d for d in ck.iterdir() if _STALE.match(d.name) and d.is_dir())
    notes = []
    for path in stale:
        if not (path.exists() or path.is_symlink()):
            continue
        try:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            notes.append(f"removed {path}, left by a run that died while writing it")
        except OSError as e:
            notes.append(f"could not remove the stale {path} ({e.strerror})")
    return notes


_STALE = re.compile(r"^step_\d{6,}\.tmp$")


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    out, p = [], Path(path).absolute()
    while not p.exists() and p != p.parent:
        out.append(p)
        p = p.parent
    return out


def _prepare(cfg, out_dir: Path, ck: Path, mode: str, is_rank0: bool, restart: bool,
             lock: bool) -> RunPlan:
    plan = RunPlan()
    check_writable(out_dir, "training.out_dir")
    check_writable(ck, "checkpoint.dir" if cfg.checkpoint.dir else "training.out_dir")
    if is_rank0 and lock:
        plan.lock = acquire_lock(out_dir)
    owner = is_rank0 and (lock or restart)  # no live writer but us (see clean_stale)
    if mode == "fresh" and not restart:
        if is_rank0:
            plan.notes += clean_stale(out_dir, ck) if owner else []
            plan.notes += [f"--fresh: moved {m}" for m in move_aside(cfg)]
        return plan
    path, skipped = checkpoint.find_resumable(ck)
    plan.notes += [f"skipping {reason}" for reason in skipped]
    if path is None:
        if skipped:
            raise CheckpointError(f"no usable checkpoint in {str(ck)!r} (newest: {skipped[0]}); "
                                  "--fresh moves them aside and starts over")
        if mode == "resume":
            raise RunDirError(f"--resume: no complete checkpoint in {str(ck)!r}")
        metrics = out_dir / "metrics.jsonl"
        plan.notes += clean_stale(out_dir, ck) if owner else []
        if is_rank0 and metrics.is_file() and not restart:  # a run that died before saving
            plan.notes += [f"starting at step 0; moved {m}" for m in move_aside(cfg)]
        elif is_rank0 and metrics.is_file():
            truncate_metrics(metrics, 0)
        return plan
    meta = checkpoint.read_meta(path)
    check_compatible(cfg, path, meta)
    plan.resume_from = path  # rank 0 says so in one line once the trainer has loaded it
    plan.notes += clean_stale(out_dir, ck) if owner else []
    if is_rank0:
        truncate_metrics(out_dir / "metrics.jsonl", saved_step(meta))
    return plan
