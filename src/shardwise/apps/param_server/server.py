"""A server rank: owns one key range, applies updates as gradients arrive, answers pulls.

Li et al., OSDI 2014 (server nodes, range partitioning); the consistency rules are in
``clock.py``. One receiver thread per worker blocks in ``comm.recv`` on that worker's next
request and hands it to the main loop through a queue, so the server serves whichever
worker speaks first (p2p needs a known source; a thread per source gives "any source"
without backend support for it). One sender thread per worker sends the replies the main
loop queues for it (a copy of the range, taken when the pull is answered): a send blocks
until its worker posts the receive, and a worker receives from the servers in order, so a
main loop that sent itself could wait on a worker that waits on another server, which may
be in a collective checkpoint waiting on this one (that deadlock hung SSP jobs; the main
loop must never block on a worker). The main loop alone touches the weights and the
clocks, so no lock guards them. Nothing here uses ``async_op``, so comm runs each call
inline in its calling thread. Tested on CPU + gloo; with NCCL, p2p from several threads
would go through torch's per-pair communicators (untested).
"""

from __future__ import annotations

import queue
import sys
import threading
import time

import torch

from shardwise import comm
from shardwise.apps.param_server import protocol as P
from shardwise.apps.param_server import state
from shardwise.apps.param_server.clock import ClockTable
from shardwise.apps.param_server.optim import RangeOptimizer
from shardwise.apps.param_server.partition import KeyRanges

_DEAD = -1


class Server:
    """Server ``index`` of a job with ``workers`` workers at global ranks
    ``worker_ranks[w]``.

    Args:
        part: the key-range partition; this server owns ``part.server_keys(index)``.
        values: the initial flat weights of the whole model (shape ``(part.numel,)``).
        consistency, staleness: see ``clock.py``.
        optimizer, momentum, o, total: the update (``optim.RangeOptimizer``).

        checkpointing: ``{"root", "every", "keep", "at_end", "group", "meta"}``: save every
            ``every`` applied clocks (BSP/SSP) and at the end, collectively over ``group``
            (the servers); see ``state.py``. ``resume_from``: a checkpoint to start from.

    ``serve()`` runs until every worker has finished or died and returns the final
    range and the pull log.
    """

    def __init__(self, index: int, part: KeyRanges, values: torch.Tensor,
                 worker_ranks: list[int], consistency: str, staleness: int, optimizer: str,
                 o, total: int, momentum: float = 0.9, worker_timeout_s: float = 60.0,
                 checkpointing: dict | None = None, resume_from=None):
        self.index, self.worker_ranks = index, list(worker_ranks)
        self.worker_timeout_s = worker_timeout_s
        self.lo, self.hi = part.bounds(index)
        self.device = values.device
        self.range = RangeOptimizer(part.server_keys(index), values[self.lo:self.hi], optimizer,
                                    o, total, momentum)
        self.table = ClockTable(len(worker_ranks), consistency, staleness)
        self.version = 0                                  # updates applied so far
        self.pending: dict[int, dict[int, torch.Tensor]] = {}  # clock -> worker -> gradient
        self.waiting: dict[int, tuple[int, int]] = {}     # worker -> (clock, version held)
        self.finished: set[int] = set()
        self.dead: set[int] = set()
        self.events: queue.Queue = queue.Queue()
        # worker -> its replies, (kind, clock, version, payload or None); None ends the thread
        self.replies: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in worker_ranks]
        self.pull_log: list[tuple[int, int, int, int]] = []  # (worker, clock, slowest, t_us)
        self.unchanged = 0                                # pulls answered without payload
        self.rejoined: list[int] = []                     # dropped workers taken back
        self.optimizer, self.ckpt = optimizer, checkpointing
        if resume_from is not None:
            meta = state.load(resume_from, self.range, optimizer, checkpointing["group"])
            start = int(meta["applied"])
            self.table.applied = start
            self.table.clocks = [start] * len(worker_ranks)
            self.version = start

    # -- receiving --------------------------------------------------------------------------
    def _receive(self, w: int) -> None:
        """Thread: forward worker ``w``'s requests to the main loop until DONE or failure."""
        src = self.worker_ranks[w]
        try:
            while True:
                kind, _, clock, version = P.recv_header(src, P.TAG_REQUEST, self.device)
                if kind == P.PUSH:
                    grad = torch.empty(self.hi - self.lo, dtype=torch.float32, device=self.device)
                    comm.recv(grad, src, tag=P.TAG_REQUEST)
                    self.events.put((P.PUSH, w, clock, grad))
                else:
                    self.events.put((kind, w, clock, version))
                if kind == P.DONE:
                    return
        except Exception as exc:  # a dead or hung worker: drop it, carry on
            self.events.put((_DEAD, w, -1, str(exc).splitlines()[0][:200]))

    def _reply(self, w: int) -> None:
        """Thread: send worker ``w`` the replies the main loop queues, in order, until None.
        A failed send reports the worker dead to the main loop and drops what is left."""
        dst, failed = self.worker_ranks[w], False
        while (item := self.replies[w].get()) is not None:
            if failed:
                continue
            kind, clock, version, payload = item
            try:
                P.send_header(dst, P.TAG_REPLY, kind, w, clock, version, self.device)
                if payload is not None:
                    comm.send(payload, dst, tag=P.TAG_REPLY)
            except comm.CommError as exc:
                failed = True
                self.events.put((_DEAD, w, -1, str(exc).splitlines()[0][:200]))

    # -- the main loop ----------------------------------------------------------------------
    def serve(self) -> dict:
        """Serve the workers until each has finished or been dropped as dead: apply pushes, answer
        pulls under the consistency bound, checkpoint, send worker 0 the final weights. Returns this
        server's summary (its slice of the weights, updates, pull log, dead and rejoined workers).
        """
        threads = [threading.Thread(target=self._receive, args=(w,), daemon=True,
                                    name=f"ps-recv-{w}") for w in range(len(self.worker_ranks))]
        senders = [threading.Thread(target=self._reply, args=(w,), daemon=True,
                                    name=f"ps-send-{w}") for w in range(len(self.worker_ranks))]
        for t in threads + senders:
            t.start()
        started = time.perf_counter()
        # when each worker last spoke; None until its first request (a worker still starting
        # up is bounded by comm's timeout, parallel.timeout_s, not by worker_timeout_s)
        self.heard: list[float | None] = [None] * len(self.worker_ranks)
        while len(self.finished | self.dead) < len(self.worker_ranks):
            try:
                event = self.events.get(timeout=min(1.0, self.worker_timeout_s / 4))
            except queue.Empty:
                self._drop_silent()
            else:
                self.heard[event[1]] = time.perf_counter()
                self._handle(*event)
            self._answer_pulls(started)
        if self.ckpt is not None and self.ckpt["at_end"]:
            done = self.table.applied if self.table.bound is not None else min(self.table.clocks)
            if not (self.ckpt["every"] and done % self.ckpt["every"] == 0
                    and self.table.bound is not None and done < self.range.total):
                self._save(done)
        if 0 in self.finished:  # worker 0 evaluates the final weights
            self.replies[0].put((P.FINAL, self.table.applied, self.version,
                                 self.range.flat.clone()))
        for q in self.replies:
            q.put(None)
        for t in senders:  # every reply sent (or failed: comm's timeout bounds each send)
            t.join()
        for t in threads:
            t.join(timeout=1.0)
        return {"role": "server", "index": self.index, "flat": self.range.flat.clone(),
                "bounds": [self.lo, self.hi], "updates": self.version,
                "pull_log": [list(e) for e in self.pull_log], "unchanged_pulls": self.unchanged,
                "dead": sorted(self.dead), "rejoined": self.rejoined}

    def _handle(self, kind: int, w: int, clock: int, arg) -> None:
        if (w in self.dead and kind in (P.PUSH, P.PULL) and self.table.can_rejoin(clock)):
            self.dead.discard(w)  # it was only silent: take it back
            self.table.rejoin(w, clock)
            self.rejoined.append(w)
            print(f"shardwise ps: server {self.index}: worker {w} rejoined at clock {clock}",
                  file=sys.stderr, flush=True)
        if kind == P.PUSH:
            if w in self.dead:  # too late to count (its clock is applied): ignored
                return
            self.table.push(w, clock)
            if self.table.bound is None:  # ASP: every push is one step
                self.range.apply(arg, clock)
                self.version += 1
            else:
                self.pending.setdefault(clock, {})[w] = arg
                self._apply_ready()
        elif kind == P.PULL:
            self.waiting[w] = (clock, arg)
        elif kind == P.DONE:
            self.finished.add(w)
        elif kind == _DEAD and w not in self.finished:
            self.dead.add(w)
            self.waiting.pop(w, None)
            self.table.drop(w)
            print(f"shardwise ps: server {self.index}: worker {w} dropped at clock "
                  f"{self.table.clocks[w]} ({arg}); the others carry on", file=sys.stderr,
                  flush=True)
            self._apply_ready()

    def _drop_silent(self) -> None:
        """Drop a worker that owes us a request (it is not waiting for a reply) and has been
        silent for ``worker_timeout_s``: hung, or dead without its connection closing."""
        now = time.perf_counter()
        for w in range(len(self.worker_ranks)):
            if (w not in self.finished and w not in self.dead and w not in self.waiting
                    and self.heard[w] is not None
                    and now - self.heard[w] > self.worker_timeout_s):
                self._handle(_DEAD, w, -1, f"silent for {now - self.heard[w]:.0f} s")

    def _apply_ready(self) -> None:
        """BSP/SSP: apply every clock all live workers have pushed, in clock order, as one
        step on the mean of its gradients (summed in worker order: deterministic)."""
        while (k := self.table.ready()) is not None:
            grads = self.pending.pop(k, {})
            if grads:
                acc = None
                for w in sorted(grads):
                    acc = grads[w].clone() if acc is None else acc.add_(grads[w])
                self.range.apply(acc.div_(len(grads)), k)
                self.version += 1
            self.table.mark_applied(k)
            every = self.ckpt["every"] if self.ckpt is not None else 0
            if every and (k + 1) % every == 0 and k + 1 < self.range.total:
                self._save(k + 1)

    def _save(self, clock: int) -> None:
        c = self.ckpt
        state.save(c["root"], clock, self.range, self.optimizer, c["meta"], c["keep"], c["group"])

    def _answer_pulls(self, started: float) -> None:
        for w in sorted(self.waiting):
            clock, held = self.waiting[w]
            if not self.table.may_pull(clock):
                continue
            del self.waiting[w]
            slowest = self.table.slowest()
            self.pull_log.append((w, clock, -1 if slowest is None else slowest,
                                  int((time.perf_counter() - started) * 1e6)))
            if held == self.version:
                self.unchanged += 1
                self.replies[w].put((P.UNCHANGED, clock, self.version, None))
            else:  # a copy: the range may change before the sender thread sends it
                self.replies[w].put((P.WEIGHTS, clock, self.version, self.range.flat.clone()))
