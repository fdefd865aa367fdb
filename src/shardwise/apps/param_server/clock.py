"""Consistency rules of the parameter server as pure logic (no processes, no tensors).

A worker's *clock* counts the gradients it has pushed: it computes clock c on weights it
pulled while at clock c, then pushes gradient c and moves to clock c + 1.

- BSP (bulk synchronous): clock k is applied once every live worker has pushed clock k, as
  one step on the mean of their gradients; a worker may pull for clock c only when clocks
  0..c-1 are all applied. This is synchronous data parallelism.
- SSP (stale synchronous, Ho et al., NIPS 2013, "More Effective Distributed ML via a Stale
  Synchronous Parallel Parameter Server"): clocks are applied as in BSP, but a worker at
  clock c may pull as soon as the slowest live worker has reached clock c - s, so it reads
  weights missing at most its s newest clocks (Li et al.'s "bounded delay", OSDI 2014,
  section 3.3). s = 0 is BSP, the same code path.
- ASP (asynchronous, Dean et al.'s Downpour SGD, NIPS 2012): every push is applied at once
  as its own step; pulls never wait.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.base.config import PS_CONSISTENCIES as CONSISTENCIES  # ps.consistency's


@dataclass
class ClockTable:
    """Per-worker clocks on one server, and which workers are live.

    ``clocks[w]``: number of gradients worker ``w`` has pushed (its current clock).
    ``applied``: BSP/SSP: number of clocks applied (0..applied-1 are in the weights).
    """

    workers: int
    consistency: str = "bsp"
    staleness: int = 0
    clocks: list[int] = field(default_factory=list)
    live: set[int] = field(default_factory=set)
    applied: int = 0

    def __post_init__(self) -> None:
        if self.consistency not in CONSISTENCIES:
            raise ValueError(f"consistency must be one of {CONSISTENCIES}, "
                             f"got {self.consistency!r}")
        if self.workers < 1 or self.staleness < 0:
            raise ValueError(f"need workers >= 1 and staleness >= 0, got {self.workers}, "
                             f"{self.staleness}")
        if self.consistency == "bsp":
            self.staleness = 0
        self.clocks = [0] * self.workers
        self.live = set(range(self.workers))

    @property
    def bound(self) -> int | None:
        """Clocks a reader may run ahead of the slowest live worker (None: unbounded)."""
        return None if self.consistency == "asp" else self.staleness

    def slowest(self) -> int | None:
        """Smallest clock over live workers (None when no worker is live)."""
        return min((self.clocks[w] for w in self.live), default=None)

    def may_pull(self, clock: int) -> bool:
        """Whether a worker at ``clock`` may read now: ASP always; BSP/SSP once every clock
        up to ``clock - s - 1`` is applied, i.e. the slowest live worker reached ``c - s``."""
        if self.bound is None:
            return True
        return self.applied >= clock - self.bound

    def push(self, worker: int, clock: int) -> None:
        """Record worker ``worker``'s gradient of ``clock``; pushes come in clock order."""
        if worker not in self.live:
            raise ValueError(f"worker {worker} is not live")
        if clock != self.clocks[worker]:
            raise ValueError(f"worker {worker} pushed clock {clock}, expected "
                             f"{self.clocks[worker]}")
        self.clocks[worker] += 1

    def ready(self) -> int | None:
        """BSP/SSP: the next clock to apply when every live worker has pushed it, else None
        (ASP applies pushes as they come: always None)."""
        if self.bound is None:
            return None
        low = self.slowest()
        return self.applied if low is not None and low > self.applied else None

    def mark_applied(self, clock: int) -> None:
        """Record that ``clock`` has been applied. Raises ValueError unless it is the next clock in
        order."""
        if clock != self.applied:
            raise ValueError(f"applying clock {clock}, expected {self.applied}")
        self.applied += 1

    def can_rejoin(self, clock: int) -> bool:
        """Whether a dropped worker now at ``clock`` can be live again: under ASP always;
        under BSP/SSP only if that clock is not applied yet (its gradient still counts)."""
        return self.bound is None or clock >= self.applied

    def rejoin(self, worker: int, clock: int) -> None:
        """Make a dropped worker live again at ``clock`` (see ``can_rejoin``)."""
        if not self.can_rejoin(clock):
            raise ValueError(f"worker {worker} at clock {clock} cannot rejoin: clocks up to "
                             f"{self.applied - 1} are applied")
        self.live.add(worker)
        self.clocks[worker] = clock

    def drop(self, worker: int) -> None:
        """Forget worker ``worker`` (it died or finished): it no longer holds anyone back."""
        self.live.discard(worker)
