"""Files a reader sees whole or not at all: the new content is written under a temporary
name beside the file and renamed over it (``os.replace``: atomic within a filesystem,
POSIX ``rename(2)``), and the temporary file is removed when anything fails, so the file
keeps what it held. Checkpoints commit a whole directory the same way
(``checkpoint._commit``)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def temporary(path: str | Path) -> Path:
    """``NAME.tmp`` beside ``path``: where a file (or a checkpoint directory) is written
    before it is renamed over ``path``, and what a run that died while writing leaves."""
    path = Path(path)
    return path.with_name(path.name + ".tmp")


def fsync_dir(path: str | Path) -> None:
    """fsync a directory, so the renames in it survive a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str | Path, *, unique: bool = False,
              durable: bool = False) -> Iterator[Path]:
    """Yield the temporary path to write ``path``'s new content to; when the block ends
    without an exception, rename it over ``path``; when the block or the rename raises,
    remove it and re-raise (``path`` untouched).

    The temporary name is ``temporary(path)`` (one writer at a time: the name a resumed
    run recognises as left by a crash), or with ``unique`` a fresh
    ``.NAME.XXXXXXXX.tmp`` (``tempfile.mkstemp``) for writers that may race, given the
    permissions ``open`` would give (0666 less the umask, not mkstemp's 0600).
    ``durable``: fsync the file before the rename and its folder after, so that both
    survive a power cut."""
    path = Path(path)
    fd = None
    if unique:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        tmp = Path(name)
    else:
        tmp = temporary(path)
    try:
        if fd is not None:
            try:
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(fd, 0o666 & ~umask)
            finally:
                os.close(fd)
        yield tmp
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_text(path: str | Path, text: str, *, unique: bool = False,
               durable: bool = False) -> Path:
    """``Path.write_text(text)`` (UTF-8) through ``replacing``: ``path`` holds the old text
    or the whole new one. Returns ``path``."""
    with replacing(path, unique=unique, durable=durable) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def save_figure(fig, path: str | Path, **savefig_kwargs) -> Path:
    """``fig.savefig`` (a matplotlib figure) through ``replacing``, in the format ``path``'s
    suffix names (png where it has none: the temporary name's suffix is .tmp, so the
    format is passed). Returns ``path``."""
    path = Path(path)
    with replacing(path) as tmp:
        fig.savefig(tmp, format=path.suffix[1:] or "png", **savefig_kwargs)
    return path
