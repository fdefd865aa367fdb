"""Errors that stop a run for a reason one line explains (no traceback, never retried).

A rank that raises a ``RunError`` reports ``str(err)`` to the launcher, which prints that
one line and does not restart the gang under ``--max-restarts``: the same input would fail
the same way again. An ``InputError`` (or an ``OSError`` of a full, read-only or forbidden
disk, ``user_error_line``) is the user's to fix: the launcher exits with code 2 for it.
"""

from __future__ import annotations

import errno

# a full disk or quota, a read-only file system, a denied permission: the user's to fix
USER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class RunError(Exception):
    """A run cannot go on; ``str(err)`` is one line naming the cause."""


class InputError(RunError):
    """A run cannot go on because of its input or its environment (a setting that differs
    from the checkpoint's, a full disk); one line naming the field or file, exit code 2."""


class StorageError(InputError):
    """Writing a run's output failed (``OSError``: ENOSPC, EACCES, ...); one line naming the
    file and the errno (``storage_error``)."""


class CheckpointError(RunError, ValueError):
    """No usable checkpoint, or one that must not be written or read; one line naming it."""


class NonFiniteLossError(RunError, FloatingPointError):
    """The training loss became NaN or Inf: the run stops before anything is saved."""


def os_error_in(exc: BaseException | None) -> OSError | None:
    """The ``OSError`` that caused ``exc``: itself, one in its ``__cause__`` / ``__context__``
    chain, or the first rank's in a ``torch.distributed.checkpoint`` ``CheckpointException``
    (its ``failures``: rank -> wrapped exception); ``None`` if there is none."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError):
            return exc
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            for wrapped in failures.values():
                inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
                found = os_error_in(getattr(inner, "exc", inner))
                if found is not None:
                    return found
        exc = exc.__cause__ or exc.__context__
    return None


def storage_error(e: OSError, what: str, hint: str = "") -> StorageError:
    """One line for a failed write of ``what`` (a path, or a phrase naming it): the file
    the OS names (if any), its message and errno name: ``cannot write PATH: No space left on
    device (ENOSPC, errno 28)``, then ``hint``."""
    name = errno.errorcode.get(e.errno, "?") if e.errno is not None else type(e).__name__
    where = what if e.filename is None or str(e.filename) == str(what) \
        else f"{what} ({e.filename})"
    line = f"cannot write {where}: {e.strerror or e} ({name}, errno {e.errno})"
    return StorageError(line + (f"; {hint}" if hint else ""))


def user_error_line(exc: BaseException) -> str | None:
    """The one line for an error the user can fix: an ``InputError``'s message, or a write
    that an ``OSError`` in ``USER_ERRNOS`` stopped (naming its file); ``None`` for any other
    error (a bug, reported with its traceback)."""
    if isinstance(exc, InputError):
        return str(exc)
    os_err = os_error_in(exc)
    if os_err is not None and os_err.errno in USER_ERRNOS:
        return str(storage_error(os_err, os_err.filename or "a run output"))
    return None
