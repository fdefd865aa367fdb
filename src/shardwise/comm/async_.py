"""Asynchronous collectives: one communication thread per process, FIFO.

Our algorithms are sequences of blocking rounds, so an ``async_op=True`` call is queued to a
single background thread and returns a ``Handle`` at once. Because every rank enqueues its
collectives in the same program order and one thread executes them in that order, the p2p
messages of different collectives never cross, even when DDP issues them from autograd
hooks while earlier ones are still in flight (the same reasoning as NCCL's one stream per
communicator). A synchronous call runs inline when nothing is queued, else it is queued and
waited for, so it too keeps its place in the order.

The thread is a daemon (a process may exit with it idle) and ``shutdown()`` stops it.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable

import torch

_STOP = object()


class Handle:
    """Result of an async collective. ``wait()`` blocks until done; raises its error."""

    __slots__ = ("_future",)

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the collective finished (the tensor holds the result); True.

        Errors of the collective (``CommError``, ``CommTimeoutError``) are raised here.
        ``timeout`` in seconds bounds only this wait; the collective's own deadline is
        ``shardwise.comm.configure(timeout_s=...)``.
        """
        self._future.result(timeout)
        return True

    def is_completed(self) -> bool:
        """True when the collective has finished (successfully or not); never blocks."""
        return self._future.done()


class _Done:
    """Handle of something already finished (a one-rank group, a sync call made async)."""

    __slots__ = ()

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _Done()


class _Executor:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, future = item
            item = None
            try:
                with torch.no_grad():  # collectives move data; autograd is the caller's
                    result, error = fn(), None
            except BaseException as exc:  # delivered to wait()
                result, error = None, exc
            # drop the call before its caller resumes: the tensors it captured are then freed
            # by the caller, when it lets them go (not here, later, or when the next call
            # arrives), so their lifetimes do not depend on this thread's timing
            fn = None
            try:
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
            finally:
                future = result = error = None
                with self._lock:
                    self._pending -= 1

    def submit(self, fn: Callable[[], object]) -> Handle:
        future: Future = Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="shardwise-comm",
                                                daemon=True)
                self._thread.start()
            self._pending += 1
        self._queue.put((fn, future))
        return Handle(future)

    def run(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` now if nothing is queued, else after everything queued before it."""
        if self._pending == 0:
            with torch.no_grad():
                return fn()
        return self.submit(fn)._future.result()

    def idle(self) -> bool:
        return self._pending == 0

    def shutdown(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._queue.put(_STOP)
            thread.join()


executor = _Executor()


def drain() -> None:
    """Wait until every queued collective of this process has run."""
    if not executor.idle():
        executor.submit(lambda: None).wait()


def shutdown() -> None:
    """Finish queued collectives and stop the communication thread (it restarts on demand)."""
    drain()
    executor.shutdown()
