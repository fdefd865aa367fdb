"""Errors that stop a run for a reason one line explains (no traceback, never retried).

A rank that raises a ``RunError`` reports ``str(err)`` to the launcher, which prints that
one line and does not restart the gang under ``--max-restarts``: the same input would fail
the same way again.
"""

from __future__ import annotations


class RunError(Exception):
    """A run cannot go on; ``str(err)`` is one line naming the cause."""


class CheckpointError(RunError, ValueError):
    """No usable checkpoint, or one that must not be written or read; one line naming it."""


class NonFiniteLossError(RunError, FloatingPointError):
    """The training loss became NaN or Inf: the run stops before anything is saved."""
