"""Point-to-point layer under every collective: groups, rounds of isend/irecv, timeouts,
reduce ops, and the cross-rank argument check.

A collective is written as a sequence of *rounds* (the "time steps" of Thakur, Rabenseifner
& Gropp 2005, "Optimization of Collective Communication Operations in MPICH"). In one round a
rank posts all its receives and sends, then waits for all of them; the round number is the
global step of the algorithm's schedule, so a rank that is idle in early rounds (a leaf of a
binomial tree) still labels its one message with the right step. ``Call.exchange`` is the
only place where bytes cross ranks, so it is also the only place where they are counted.

Errors: every failure is a ``CommError`` naming the collective, the algorithm, this rank and
the peer; a wait longer than the configured timeout (default 300 s, see ``configure``)
raises ``CommTimeoutError`` instead of hanging.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from shardwise.comm import accounting

REDUCE_OPS = ("sum", "mean", "max", "min")


class CommError(RuntimeError):
    """A collective failed; the message names the collective, the rank and the cause."""


class CommTimeoutError(CommError, TimeoutError):
    """A rank waited longer than the configured timeout for a peer."""


@dataclass
class Settings:
    """Process-wide knobs of ``shardwise.comm`` (set with ``configure``).

    timeout_s: seconds any one collective may wait for its peers before ``CommTimeoutError``.
    check: before moving data, ranks agree on (collective, algorithm, op, dtype, numel,
        root, group, call number) in ceil(log2 N) rounds of 72-byte messages. Without it a
        shape mismatch can make gloo abort the process ("Received data size doesn't match")
        and a dtype mismatch of equal width silently yields garbage. Its traffic is
        accounted under the collective name "check", never mixed into the algorithm's row.
    segment_bytes: ring all-reduce cuts each chunk into pieces of about this size and
        pipelines them: piece j goes on to its next step as soon as it has arrived (and
        been added), so the all-gather starts while the reduce-scatter still runs (0: no
        pieces, the two-phase ring). The ring reduce-scatter alone (``reduce_scatter_tensor``)
        cuts its steps the same way and reduces piece i while i+1.. arrive. Bytes are
        unchanged; each step then counts one message per piece. 2 MiB was the fastest of
        0.5 / 1 / 2 / 4 MiB at 16 and 64 MiB on the development machine.
    """

    timeout_s: float = 300.0
    check: bool = True
    segment_bytes: int = 2 << 20


settings = Settings()


def configure(timeout_s: float | None = None, check: bool | None = None,
              segment_bytes: int | None = None) -> Settings:
    """Change the process-wide settings; returns them. Call it identically on every rank."""
    if segment_bytes is not None:
        if segment_bytes < 0:
            raise ValueError(f"segment_bytes must be >= 0, got {segment_bytes}")
        settings.segment_bytes = int(segment_bytes)
    if timeout_s is not None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        settings.timeout_s = float(timeout_s)
    if check is not None:
        settings.check = bool(check)
    return settings


# ---------------------------------------------------------------------------- groups

@dataclass(frozen=True)
class GroupInfo:
    """The ranks of a group in group order, and where this process sits among them."""

    group: Any              # the ProcessGroup passed by the caller (None: the world)
    ranks: tuple[int, ...]  # global rank of each group rank
    rank: int               # this process's group rank

    @property
    def size(self) -> int:
        """Ranks in the group."""
        return len(self.ranks)

    @property
    def global_rank(self) -> int:
        """This rank's global rank (its rank in the default group)."""
        return self.ranks[self.rank]


def group_info(group, collective: str) -> GroupInfo:
    """Resolve ``group``; ``CommError`` if torch.distributed is down or we are not a member."""
    if not dist.is_available() or not dist.is_initialized():
        raise CommError(f"{collective}: torch.distributed is not initialized "
                        "(call shardwise.launch.init_distributed or spawn first)")
    me = dist.get_rank()
    if group is None or group is dist.group.WORLD:
        ranks = tuple(range(dist.get_world_size()))
    else:
        try:
            ranks = tuple(dist.get_process_group_ranks(group))
        except Exception as exc:
            raise CommError(f"{collective} on rank {me}: not a usable process group: {exc}") \
                from exc
    if me not in ranks:
        raise CommError(f"{collective} on rank {me}: this rank is not a member of the group "
                        f"with global ranks {list(ranks)}")
    return GroupInfo(group, ranks, ranks.index(me))


def group_rank_of(info: GroupInfo, global_rank: int, collective: str, what: str) -> int:
    """Group rank of a global ``src``/``dst``; ``CommError`` if it is not in the group."""
    if global_rank not in info.ranks:
        raise CommError(f"{collective} on rank {info.global_rank}: {what}={global_rank} is not "
                        f"in the group with global ranks {list(info.ranks)}")
    return info.ranks.index(global_rank)


# ---------------------------------------------------------------------------- host staging

def backend_of(group) -> str:
    """The backend of ``group`` (None: the world) in lower case: "gloo", "nccl", "fake"..."""
    try:
        return str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):
        return "gloo"


class HostCopy:
    """A page-locked host copy of a CUDA tensor, for a backend that moves host memory only.

    Gloo reads and writes host memory (its send/recv and reduce-scatter take CPU tensors
    only); with several ranks sharing one GPU (``training.device = "cuda"`` with
    ``parallel.backend = "gloo"``: the mode in which the multi-rank suites run on one lent
    GPU) every CUDA tensor that crosses ranks goes through one of these. ``host`` is pinned
    (torch's caching host allocator reuses it), filled from ``t`` when ``fill``; ``back()``
    copies it into ``t``. Both copies are synchronous on the current stream, so the data is
    in place before gloo reads it and before the caller reads the result."""

    def __init__(self, t: torch.Tensor, fill: bool = True) -> None:
        self.t = t
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        if fill:
            self.host.copy_(t)

    def back(self) -> None:
        """Copy the host buffer back into the CUDA tensor (synchronous on the current stream)."""
        self.t.copy_(self.host)


def host_copy(group, t: torch.Tensor, fill: bool = True) -> HostCopy | None:
    """A ``HostCopy`` of ``t`` when ``group``'s backend is gloo and ``t`` is on CUDA, else
    None (the backend takes ``t`` as it is)."""
    if t.device.type != "cuda" or backend_of(group) != "gloo":
        return None
    return HostCopy(t, fill)


def native_buffer(group, t: torch.Tensor, fill: bool = True):
    """``(buffer, done)``: the tensor a backend collective should read/write in place of
    ``t`` (``t`` itself, or its ``HostCopy``), and ``done()``, which copies the result back
    into ``t`` (a no-op without staging)."""
    h = host_copy(group, t, fill)
    if h is None:
        return t, lambda: None
    return h.host, h.back


# ---------------------------------------------------------------------------- reduce ops

def check_op(op: str, dtype: torch.dtype, collective: str) -> None:
    """Check a reduction ``op`` for ``dtype``: one of REDUCE_OPS, ``mean`` only on floating or
    complex dtypes, ``max``/``min`` not on complex. Raises ValueError naming ``collective``."""
    if op not in REDUCE_OPS:
        raise ValueError(f"{collective}: op must be one of {REDUCE_OPS}, got {op!r}")
    if op == "mean" and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{collective}: op 'mean' needs a floating or complex dtype, got {dtype}")
    if op in ("max", "min") and dtype.is_complex:
        raise ValueError(f"{collective}: op {op!r} is undefined for complex dtype {dtype}")


def combine_(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    """``acc <- acc (op) other`` elementwise, in place. ``mean`` sums here; see ``finish_``."""
    combine_into(acc, other, acc, op)


def combine_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, op: str) -> None:
    """``out <- a (op) b`` elementwise (``out`` may be ``a`` or ``b``). Every op here is
    commutative elementwise, so swapping the operands gives the same bits."""
    if op in ("sum", "mean"):
        if out.dtype == torch.bool:
            torch.logical_or(a, b, out=out)  # what gloo's SUM gives for bool
        else:
            torch.add(a, b, out=out)
    elif op == "max":
        torch.maximum(a, b, out=out)
    else:
        torch.minimum(a, b, out=out)


def finish_(chunk: torch.Tensor, op: str, n: int) -> None:
    """Turn a fully reduced chunk into the result: divide by the group size for ``mean``."""
    if op == "mean":
        chunk.div_(n)


def balanced_bounds(numel: int, parts: int) -> list[int]:
    """Offsets of ``parts`` contiguous chunks covering ``numel`` elements.

    The first ``numel % parts`` chunks hold one element more than the others, so chunk sizes
    differ by at most one element; chunks may be empty when ``numel < parts``.
    """
    base, extra = divmod(numel, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def segments(numel: int, seg: int) -> list[tuple[int, int]]:
    """``(start, end)`` of balanced pieces of at most about ``seg`` elements covering
    ``numel`` (one piece if ``seg <= 0``). Both ends of a message compute the same cut."""
    if seg <= 0 or numel <= seg:
        return [(0, numel)]
    b = balanced_bounds(numel, -(-numel // seg))
    return list(zip(b[:-1], b[1:]))


# ---------------------------------------------------------------------------- scratch

class _Scratch:
    """One growing receive buffer per (dtype, device), reused across calls.

    Collectives run one at a time per process (see ``async_``), so one buffer per dtype is
    enough; reusing it avoids page-faulting fresh memory on every large call.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device=None) -> torch.Tensor:
        key = (dtype, torch.device("cpu") if device is None else torch.device(device))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=key[1])
            self._bufs[key] = buf
        return buf[:numel]

    def clear(self) -> None:
        self._bufs.clear()


scratch = _Scratch()


# ---------------------------------------------------------------------------- rounds

@dataclass(frozen=True)
class Posted:
    """A message posted by ``Call.isend`` / ``Call.irecv``: wait for it with ``Call.wait``."""

    work: Any   # the torch.distributed work object
    peer: int   # group rank
    step: int
    send: bool
    staged: "HostCopy | None" = None  # a receive through host memory, copied back on wait


class Call:
    """One collective call on one rank: its rounds, its deadline, its accounting record.

    Peers are group ranks. ``exchange(step, sends, recvs)`` is one round: post every
    receive, then every send, then wait for all of them. Empty tensors are skipped on both
    sides (both sides compute the same sizes, so they skip the same messages).
    """

    __slots__ = ("name", "algorithm", "info", "deadline", "record", "label", "tag", "deferred")

    def __init__(self, name: str, algorithm: str, info: GroupInfo, nbytes: int,
                 dtype: torch.dtype | None = None, label: str | None = None,
                 account: bool = True, tag: int = 0) -> None:
        self.name, self.algorithm, self.info, self.tag = name, algorithm, info, tag
        self.deferred: list[Posted] = []  # sends waited for in close() (exchange(defer_sends))
        self.label = label or f"{name}({algorithm})"
        self.deadline = time.monotonic() + settings.timeout_s
        self.record = (accounting.open_record(name, algorithm, info.size, info.rank,
                                              info.global_rank, nbytes, dtype)
                       if account and accounting.log.enabled else None)

    @property
    def rank(self) -> int:
        """This rank's rank within the call's group."""
        return self.info.rank

    @property
    def size(self) -> int:
        """Ranks in the call's group."""
        return self.info.size

    def exchange(self, step: int, sends: Sequence[tuple[int, torch.Tensor]] = (),
                 recvs: Sequence[tuple[int, torch.Tensor]] = (),
                 on_recv: Callable[[int], None] | None = None,
                 defer_sends: bool = False) -> None:
        """One round. ``on_recv(i)`` runs as soon as ``recvs[i]`` has arrived, while later
        messages are still in flight (used to reduce segment i during transfer of i+1).

        ``defer_sends``: return once the receives are in; the sends are waited for in
        ``close()``. Only for schedules where nothing overwrites a sent region before the
        call ends, or only after the peer has provably received it (halving-doubling)."""
        posted = [self.irecv(step, peer, t) for peer, t in recvs]
        sent = [self.isend(step, peer, t) for peer, t in sends]
        for i, p in enumerate(posted):
            self.wait(p)
            if on_recv is not None and p is not None:
                on_recv(i)
        if defer_sends:
            self.deferred.extend(p for p in sent if p is not None)
        else:
            for p in sent:
                self.wait(p)

    # Non-blocking pieces of a round, for schedules that overlap rounds (the pipelined ring).
    # A message is counted when it is posted; ``wait`` bounds it by the call's deadline.

    def isend(self, step: int, peer: int, t: torch.Tensor) -> "Posted | None":
        """Post a send of ``t`` to group rank ``peer`` labelled with ``step`` (None if empty)."""
        return self._post(step, peer, t, True)

    def irecv(self, step: int, peer: int, t: torch.Tensor) -> "Posted | None":
        """Post a receive into ``t`` from group rank ``peer`` (None if ``t`` is empty)."""
        return self._post(step, peer, t, False)

    def _post(self, step: int, peer: int, t: torch.Tensor, send: bool) -> "Posted | None":
        if not t.numel():
            return None
        rank, group = self.info.ranks[peer], self.info.group
        staged = host_copy(group, t, fill=send)
        buf = t if staged is None else staged.host
        try:
            work = (dist.isend(buf, rank, group=group, tag=self.tag) if send else
                    dist.irecv(buf, rank, group=group, tag=self.tag))
        except Exception as exc:
            raise self._error(f"posting step {step} failed: {exc}") from exc
        if self.record is not None:
            self.record.add_message(step, t.numel() * t.element_size(), send)
        # a staged send keeps its host copy alive through ``work`` until it is waited for
        return Posted(work, peer, step, send, staged)

    def wait(self, posted: "Posted | None") -> None:
        """Wait for a posted message (no-op for None) under this call's deadline."""
        if posted is not None:
            self._wait(posted.work, "send to" if posted.send else "receive from", posted.peer,
                       posted.step)
            if posted.staged is not None and not posted.send:
                posted.staged.back()

    def wait_native(self, work) -> None:
        """Wait for a backend collective's work object under this call's deadline."""
        self._wait(work, "the backend collective with", None, 1)

    def _wait(self, work, what: str, peer: int | None, step: int) -> None:
        left = self.deadline - time.monotonic()
        who = "the group" if peer is None else f"rank {self.info.ranks[peer]}"
        if left <= 0:
            raise self._timeout(what, who, step)
        try:
            work.wait(timeout=timedelta(seconds=left))
        except Exception as exc:
            if time.monotonic() >= self.deadline - 0.05 or "timed out" in str(exc).lower():
                raise self._timeout(what, who, step) from exc
            raise self._error(f"step {step}: {what} {who} failed: {exc}") from exc

    def _timeout(self, what: str, who: str, step: int) -> CommTimeoutError:
        return CommTimeoutError(
            f"{self._where()}: timed out after {settings.timeout_s:g} s in step {step} "
            f"waiting to {what} {who} (a rank that never arrived, or ranks that called "
            "different collectives?)")

    def _error(self, msg: str) -> CommError:
        return CommError(f"{self._where()}: {msg}")

    def _where(self) -> str:
        i = self.info
        return (f"{self.label} on rank {i.global_rank} "
                f"(group rank {i.rank} of {i.size})")

    def close(self) -> None:
        """Wait for deferred sends, then file the accounting record."""
        deferred, self.deferred = self.deferred, []
        for p in deferred:
            self.wait(p)
        if self.record is not None:
            accounting.log.append(self.record)
            self.record = None


def reduce_round(call: Call, step: int, send: torch.Tensor, dst: int, mine: torch.Tensor,
                 src: int, op: str, defer_sends: bool = False) -> None:
    """One round of a reducing algorithm (ring reduce-scatter, recursive halving): send
    ``send`` to group rank ``dst`` while receiving from ``src`` the peer's copy of the region
    ``mine`` holds, and reduce it into ``mine`` (``op``). Both messages are cut into pieces of
    about ``settings.segment_bytes`` (the sender's ``send`` is the receiver's ``mine``, so the
    cuts agree), and piece i is reduced while pieces i+1.. still arrive. ``defer_sends``: see
    ``Call.exchange``."""
    seg = settings.segment_bytes // send.element_size()
    tmp = scratch.get(mine.numel(), mine.dtype, mine.device)
    cut_r = segments(mine.numel(), seg)
    tmps, mines = [tmp[a:b] for a, b in cut_r], [mine[a:b] for a, b in cut_r]
    call.exchange(step, sends=[(dst, send[a:b]) for a, b in segments(send.numel(), seg)],
                  recvs=[(src, t) for t in tmps],
                  on_recv=lambda i: combine_(mines[i], tmps[i], op), defer_sends=defer_sends)
