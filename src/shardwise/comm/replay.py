"""Record and replay the collectives of a region that autograd recomputes.

Selective activation recomputation (``parallel.activation_checkpoint``) runs a layer's
forward again in backward; running its collectives again (tp's g all-reduce, sequence
parallelism's all-gather and reduce-scatter, the experts' all-to-all...) would move their
bytes twice. As Megatron-LM (Korthikanti et al. 2022, arXiv:2205.05198, section 5) and
torchtitan's op-level selective checkpointing, this module keeps what they returned, at the
one place every collective of ``shardwise.comm`` passes (``api._launch``): ``with
log.recording():`` runs each collective and copies its outputs into ``log``; ``with
log.replaying():`` writes the copies back in the same order and moves nothing, raising
``ReplayError`` when a call is not the one recorded at its place; inside ``run_again()``
collectives run again (the cp ring's key/value shifts, ``parallel.context.ring_comm``:
keeping them would hold cp - 1 blocks per layer). State is per thread. Details:
docs/comm.md, "Recomputed regions: record and replay".
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

from shardwise.comm.async_ import DONE, executor
from shardwise.comm.primitives import CommError


class ReplayError(CommError):
    """A recomputed region called another collective than its forward did at that place."""


@dataclass
class _Entry:
    collective: str
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    saved: list[torch.Tensor] | None = None  # the outputs' copies; None until done
    replayed: bool = False  # written back once: the copies are released

    def describe(self) -> str:
        return f"{self.collective} of {_outs(self.shapes, self.dtypes)}"


def _outs(shapes, dtypes) -> str:
    return "(" + ", ".join(f"{tuple(s)} {str(d).replace('torch.', '')}"
                           for s, d in zip(shapes, dtypes)) + ")"


@dataclass
class CollectiveLog:
    """The collectives one forward of a recomputed region made, and their outputs' copies.

    ``name`` names the region in errors. ``nbytes``: bytes of the copies held now (they are
    released one by one as they are replayed)."""

    name: str = ""
    entries: list[_Entry] = field(default_factory=list)
    cursor: int = 0
    mode: str = ""  # "record" | "replay" while one of the two blocks is open

    @property
    def nbytes(self) -> int:
        """Bytes of the outputs' copies held now (released one by one as they are replayed)."""
        return sum(t.numel() * t.element_size() for e in self.entries for t in e.saved or ())

    @contextlib.contextmanager
    def recording(self):
        """Within the block, collectives run and their outputs are copied here."""
        with _active(self, "record"):
            yield self

    @contextlib.contextmanager
    def replaying(self):
        """Within the block, collectives write back what ``recording`` copied, in order."""
        self.cursor = 0
        with _active(self, "replay"):
            yield self

    # -- the hook of api._launch --------------------------------------------------------
    def launch(self, collective: str, outputs: Sequence[torch.Tensor], run: Callable[[], None],
               async_op: bool):
        """The hook of ``api._launch``: recording, run the collective (``run``) and keep a copy of
        ``outputs``; replaying, write the next recorded copy into ``outputs`` instead. Returns a
        handle when ``async_op``."""
        if self.mode == "replay":
            return self._replay(collective, outputs, async_op)
        entry = _Entry(collective, [tuple(t.shape) for t in outputs],
                       [t.dtype for t in outputs])
        self.entries.append(entry)

        def quiet() -> None:
            with _disable_current_modes():
                run()

        if async_op:
            return _Recorded(executor.submit(quiet), entry, outputs)
        executor.run(quiet)
        _keep(entry, outputs)
        return None

    def _replay(self, collective: str, outputs: Sequence[torch.Tensor], async_op: bool):
        shapes, dtypes = [tuple(t.shape) for t in outputs], [t.dtype for t in outputs]
        where = f"recomputing {self.name or 'a region'}: call {self.cursor} "
        if self.cursor >= len(self.entries):
            raise ReplayError(f"{where}is {collective} of {_outs(shapes, dtypes)}, but its "
                              f"forward made only {len(self.entries)} collectives")
        entry = self.entries[self.cursor]
        if (entry.collective, entry.shapes, entry.dtypes) != (collective, shapes, dtypes):
            raise ReplayError(f"{where}is {collective} of {_outs(shapes, dtypes)}, but in "
                              f"forward it was {entry.describe()}")
        if entry.replayed:
            raise ReplayError(f"{where}({entry.describe()}) was replayed already (a region "
                              "is recomputed once per forward)")
        if entry.saved is None:
            raise ReplayError(f"{where}({entry.describe()}) was never waited for in forward, "
                              "so there is no result to replay")
        with _disable_current_modes(), torch.no_grad():
            for t, s in zip(outputs, entry.saved):
                t.copy_(s)
        entry.saved, entry.replayed = None, True  # release the copies now
        self.cursor += 1
        return DONE if async_op else None


def _keep(entry: _Entry, outputs: Sequence[torch.Tensor]) -> None:
    if entry.saved is None:
        with _disable_current_modes(), torch.no_grad():
            entry.saved = [t.detach().clone() for t in outputs]


class _Recorded:
    """An asynchronous collective's handle in a recording: ``wait()`` also copies the
    outputs into the log (before the caller may reuse them)."""

    __slots__ = ("_handle", "_entry", "_outputs")

    def __init__(self, handle, entry: _Entry, outputs: Sequence[torch.Tensor]) -> None:
        self._handle, self._entry, self._outputs = handle, entry, tuple(outputs)

    def wait(self, timeout: float | None = None) -> bool:
        self._handle.wait(timeout)
        _keep(self._entry, self._outputs)
        return True

    def is_completed(self) -> bool:
        return self._handle.is_completed()


_local = threading.local()


def _stack() -> list:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


@contextlib.contextmanager
def _active(log: CollectiveLog | None, mode: str):
    stack = _stack()
    if log is not None:
        log.mode = mode
    stack.append(log)
    try:
        yield
    finally:
        stack.pop()
        if log is not None:
            log.mode = ""


def current() -> CollectiveLog | None:
    """The log the next collective of this thread goes to (None: it just runs)."""
    stack = _stack()
    return stack[-1] if stack else None


def active() -> bool:
    """Whether this thread is inside a region being recorded or replayed (and not inside
    ``run_again``): a layer may then take a path made for recomputation (e.g.
    ``tensor_parallel.mappings.linear_reduce``)."""
    return current() is not None


def hidden():
    """A context manager within which PyTorch's dispatch modes (the selective checkpoint's
    op counters) see nothing: for work a region does in forward but not when recomputed,
    or the reverse."""
    return _disable_current_modes()


def recomputing() -> bool:
    """Whether this thread is recomputing a region (a layer's forward run again for
    backward): side effects its forward already had (statistics) must not happen twice."""
    return any(log is not None and log.mode == "replay" for log in _stack())


@contextlib.contextmanager
def run_again():
    """Within the block, collectives are neither recorded nor replayed: a recomputation
    runs them again (see the module docstring for who uses it and why that is safe)."""
    with _active(None, ""):
        yield
