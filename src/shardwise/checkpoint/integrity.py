"""Checksums of a checkpoint's files, and the refusal to save non-finite tensors.

``checksums.json`` lists every file of ``step_N/`` (``.metadata``, each ``*.distcp``,
``meta.json``) with its size in bytes and SHA-256, written by rank 0 after all ranks have
written and before the directory is renamed into place. ``verify`` recomputes them; a
file that is missing, shorter or different makes the checkpoint unusable, and the caller
falls back to the previous one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from shardwise.base.errors import CheckpointError
from shardwise.data.shards import sha256_file  # the one file hash: data precedes checkpoint

MANIFEST = "checksums.json"


class IntegrityError(CheckpointError):
    """A checkpoint's files do not match its manifest; ``str`` is one line naming the file."""


def write_manifest(directory: Path) -> dict[str, Any]:
    """Hash every regular file of ``directory`` into ``directory/checksums.json`` (fsynced)."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {"algorithm": "sha256", "files": files}
    with open(directory / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def read_manifest(directory: Path) -> dict[str, Any]:
    """The checkpoint's manifest (``files``: name -> size and checksum). Raises IntegrityError when
    it is missing or unreadable."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
        assert isinstance(files, dict) and all(isinstance(v, dict) for v in files.values())
        return manifest
    except FileNotFoundError:
        raise IntegrityError(f"{directory.name}: no {MANIFEST} (written by an older shardwise "
                             "or not finished)") from None
    except (OSError, ValueError, KeyError, AssertionError) as e:
        raise IntegrityError(f"{directory.name}/{MANIFEST}: unreadable ({e})") from None


def verify(directory: str | Path) -> list[str]:
    """Check every file against the manifest; return the file names. Raises ``IntegrityError``."""
    directory = Path(directory)
    files = read_manifest(directory)["files"]
    for name, want in files.items():
        path = directory / name
        if "/" in name or not path.is_file():
            raise IntegrityError(f"{directory.name}/{name}: missing")
        size = path.stat().st_size
        if size != want.get("bytes"):
            raise IntegrityError(f"{directory.name}/{name}: {size} bytes, expected "
                                 f"{want.get('bytes')} (truncated or overwritten)")
        if sha256_file(path) != want.get("sha256"):
            raise IntegrityError(f"{directory.name}/{name}: SHA-256 differs from {MANIFEST} "
                                 "(damaged)")
    for required in (".metadata", "meta.json"):
        if required not in files:
            raise IntegrityError(f"{directory.name}: {MANIFEST} does not list {required}")
    return list(files)


def _floating(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _floating(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, torch.Tensor) and tree.is_floating_point():
        to_local = getattr(tree, "to_local", None)  # a DTensor: this rank's slice, no collective
        yield prefix, to_local() if to_local is not None else tree


def first_non_finite(tensors: dict[str, Any]) -> str | None:
    """Dotted key of the first floating tensor holding NaN or Inf, or ``None``."""
    for key, t in _floating(tensors):
        if t.numel() and not bool(torch.isfinite(t.detach()).all()):
            return key
    return None
