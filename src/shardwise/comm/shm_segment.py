"""Shared-memory segment of a group of ranks on one host: creation, rounds, lifetime.

Layout (bytes): one 64-byte control line per group rank (int64 [0]: rounds completed, [1]:
pid, [2]: a peer sleeps on [0]), padded to 4 KiB, then two *sets* of N slots of
``SLOT_BYTES`` each. A round writes the set that does not hold the previous round's data, so
a rank may write round k+1 while a slow peer still reads round k; it can write that set
again (round k+2) only after every peer arrived at round k+1, that is after every peer
finished reading round k.

Lifetime: the segment is a file ``/dev/shm/shardwise-shm-<pid of group rank 0>-<counter>-
<random token>``, created by group rank 0 (O_EXCL: a name never collides, a stale one is
refused), its name sent to the group in one backend broadcast; once every rank has mapped
it (one backend round) it is unlinked, so the memory goes away with the last process,
kill -9 included. A peer that stops raising its sequence number makes the others raise
``CommError`` (its process is gone, checked every ~0.2 s) or ``CommTimeoutError`` (after
``configure(timeout_s=...)``), naming the collective, never hang.

Waiting: a rank spins on its peers' numbers, then sets the "sleeper" word of the peer's line
and sleeps in futex(2) on the peer's number; a rank that raises its number and finds its
sleeper word set clears it and wakes the sleepers (a syscall only when someone sleeps). x86
may let the waker read the sleeper word before its raise is visible, so a wake-up can be
lost: a sleep lasts at most 2 ms, which bounds that rare cost; where futex is unavailable it
yields the core (``os.sched_yield``) and after 2 ms sleeps 50 us per check. It spins only
when the group's ranks fit on the cores it may run on (with more ranks than cores spinning
keeps the peer it waits for off the core), and adaptively: the budget (16..4096 checks)
doubles after a wait that ended while spinning and halves after one that had to yield, so a
loaded machine converges to yielding at once (measured on 2 busy cores, 4 KiB at N = 2: a
fixed 20000-spin budget 13.9 ms per call, 200 spins 0.59 ms; ``$SHARDWISE_SHM_SPIN`` fixes
the budget). Memory order: x86-64 keeps stores in order and loads in order, so data written
before a number is raised are visible to whoever sees the number (ARM would need fences; the
transport is only enabled on x86-64)."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import platform
import secrets
import time

import torch

from shardwise.comm.primitives import Call, CommError, GroupInfo

SHM_DIR = "/dev/shm"
PREFIX = "shardwise-shm-"
LINE = 8                      # int64 words per control line (64 bytes)
HEADER_ALIGN = 4096
# per rank and set; of 2, 4, 8, 16 MiB, 8 was the fastest at 64 MiB, N = 2 (2 busy cores)
SLOT_BYTES = int(os.environ.get("SHARDWISE_SHM_SLOT_BYTES", 8 << 20))
TMP_BYTES = 256 << 10  # per-dtype scratch: the reduction's chunk, the accumulator stays in L2
DEATH_CHECK_S = 0.2
FUTEX_CAP_S = 0.002  # longest futex sleep: bounds the cost of a wake-up lost to a race
SPIN = int(os.environ.get("SHARDWISE_SHM_SPIN", -1))  # spins before yielding (-1: adaptive)

_counter = itertools.count()
_segments: dict[tuple[int, ...], tuple[object, "Segment"]] = {}


def backend_group(info: GroupInfo) -> object:
    """The ProcessGroup object behind ``info`` (the default group for the world): caches
    hold it, so a process that re-initialises torch.distributed never meets a stale entry."""
    import torch.distributed as dist
    g = info.group
    if g is None or g is dist.group.WORLD:
        from torch.distributed.distributed_c10d import _get_default_group
        return _get_default_group()
    return g


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


try:  # futex(2) on the sequence numbers: a waiting rank sleeps until a peer raises its own
    _syscall = ctypes.CDLL(None, use_errno=True).syscall
    _syscall.restype = ctypes.c_long
    _syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    _SYS_FUTEX = 202 if platform.machine() == "x86_64" else None
except (OSError, AttributeError):
    _syscall, _SYS_FUTEX = None, None
FUTEX = _SYS_FUTEX is not None and os.environ.get("SHARDWISE_SHM_FUTEX", "1") != "0"


def _futex_wait(addr: int, seen: int, timeout_s: float) -> None:
    """Sleep while the int32 at ``addr`` (the low half of a sequence number) equals
    ``seen``, at most ``timeout_s``; returns at once if it already differs."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    low = seen & 0xFFFFFFFF
    _syscall(_SYS_FUTEX, addr, 0, low - (1 << 32) if low >= 1 << 31 else low,
             ctypes.addressof(ts), None, 0)


def _futex_wake(addr: int) -> None:
    _syscall(_SYS_FUTEX, addr, 1, 0x7FFFFFFF, None, None, 0)


def available() -> bool:
    """True where the transport can run: Linux-style /dev/shm, x86-64 memory order, and not
    disabled with SHARDWISE_SHM=0."""
    return (os.environ.get("SHARDWISE_SHM", "1") != "0" and os.path.isdir(SHM_DIR)
            and os.access(SHM_DIR, os.W_OK) and platform.machine() in ("x86_64", "AMD64"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except OSError:
            return True


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class Segment:
    """One group's mapped segment, and this rank's round counter in it."""

    def __init__(self, mm: mmap.mmap, ranks: tuple[int, ...], rank: int, slot_bytes: int):
        self.mm, self.ranks, self.rank, self.slot = mm, ranks, rank, slot_bytes
        self.n = len(ranks)
        self.flags = memoryview(mm).cast("q")
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(mm)) if FUTEX else 0
        self.data = torch.frombuffer(mm, dtype=torch.uint8)
        self.header = _header_bytes(self.n)
        self.seq = 0
        self.live = 1  # the set holding the data of the last round
        # spin budget: adaptive within [16, 4096] spins when the ranks fit on the cores
        self.spin_max = SPIN if SPIN >= 0 else (4096 if self.n <= _cores() else 0)
        self.spin = min(256, self.spin_max)
        self._views: dict[tuple, list[torch.Tensor]] = {}
        self._tmp: dict[torch.dtype, torch.Tensor] = {}
        self.plans: dict[tuple[int, int], tuple] = {}  # all-reduce cuts per (numel, esz)

    def slots(self, dtype: torch.dtype, keep: bool = False) -> list[torch.Tensor]:
        """The N slots (flat, ``dtype``) of the set the next round writes: the set not
        holding the last round's data (``keep``: that set, see ``all_reduce``)."""
        key = (self.live if keep else 1 - self.live, dtype)
        views = self._views.get(key)
        if views is None:
            base = self.header + key[0] * self.n * self.slot
            views = [self.data[base + j * self.slot:base + (j + 1) * self.slot].view(dtype)
                     for j in range(self.n)]
            self._views[key] = views
        return views

    def tmp(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's private scratch buffer of ``dtype`` (TMP_BYTES, allocated on first use)."""
        t = self._tmp.get(dtype)
        if t is None:
            t = self._tmp[dtype] = torch.empty(TMP_BYTES // torch.empty(0, dtype=dtype)
                                               .element_size(), dtype=dtype)
        return t

    def round(self, call: Call, step: int, keep: bool = False) -> None:
        """Raise this rank's number and wait until every peer's has reached it. The data
        written for this round live in the other set from now on (``keep``: the same)."""
        if not keep:
            self.live ^= 1
        self.seq += 1
        target, flags = self.seq, self.flags
        me = self.rank * LINE
        flags[me] = target
        if FUTEX and flags[me + 2]:  # someone sleeps on our number
            flags[me + 2] = 0
            _futex_wake(self.addr + me * 8)
        pending = [j * LINE for j in range(self.n) if j != self.rank]
        spins, start, checked = 0, None, None
        while True:
            pending = [k for k in pending if flags[k] < target]
            if not pending:
                if SPIN < 0:  # a wait that ended while spinning: spin longer next time
                    self.spin = (min(self.spin * 2, self.spin_max) if spins <= self.spin
                                 else max(self.spin // 2, min(16, self.spin_max)))
                return
            spins += 1
            if spins <= self.spin:
                continue
            now = time.monotonic()
            if start is None:
                start = checked = now
            if FUTEX:
                k = pending[0]
                flags[k + 2] = 1  # ask rank k to wake us when it raises its number
                seen = flags[k]
                if seen < target:
                    _futex_wait(self.addr + k * 8, seen, FUTEX_CAP_S)
            elif now - start < 0.002:
                os.sched_yield()
            else:
                time.sleep(50e-6)
            if now - checked >= DEATH_CHECK_S:
                checked = now
                self._check(call, step, pending, now)

    def _check(self, call: Call, step: int, pending: list[int], now: float) -> None:
        for k in pending:
            pid = self.flags[k + 1]
            if not _alive(pid):
                raise CommError(f"{call._where()}: shared-memory step {step}: rank "
                                f"{self.ranks[k // LINE]} (pid {pid}) exited")
        if now >= call.deadline:
            raise call._timeout("hear from", f"rank {self.ranks[pending[0] // LINE]}", step)

    def close(self) -> None:
        """Release the views, the scratch buffers and the mapping (left to the process's exit when a
        view is still exported)."""
        self._views.clear()
        self._tmp.clear()
        self.data = None
        try:
            self.flags.release()
            self.mm.close()
        except BufferError:  # a view still exported: the mapping goes with the process
            pass


def _header_bytes(n: int) -> int:
    return -(-n * LINE * 8 // HEADER_ALIGN) * HEADER_ALIGN


# ---------------------------------------------------------------------------- setup

def _sweep_stale() -> None:
    """Remove our user's segments older than a minute whose creating process is gone (a job
    killed between creating and unlinking its segment; the age spares a creator in another
    pid namespace, whose window is milliseconds)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    uid = os.getuid()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-")[0])
            path = os.path.join(SHM_DIR, name)
            st = os.stat(path)
            if st.st_uid == uid and time.time() - st.st_mtime > 60 and not _alive(pid):
                os.unlink(path)
        except (ValueError, OSError):
            pass


def segment(info: GroupInfo) -> Segment:
    """The segment of the ranks ``info.ranks``, created collectively on first use.

    ``info`` may be a subset of a group (its ``group`` is then the parent's ProcessGroup,
    used for the setup messages only). Raises ``CommError`` if /dev/shm cannot hold it or a
    rank cannot map it (ranks on different hosts)."""
    pg = backend_group(info)
    entry = _segments.get(info.ranks)
    if entry is None or entry[0] is not pg:
        if entry is not None:
            entry[1].close()
        entry = _segments[info.ranks] = (pg, _create(info))
    return entry[1]


def _create(info: GroupInfo) -> Segment:
    from shardwise.comm import tree

    n, r = info.size, info.rank
    size = _header_bytes(n) + 2 * n * SLOT_BYTES
    name_t = torch.zeros(96, dtype=torch.uint8)
    path, err = None, ""
    if r == 0:
        _sweep_stale()
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}-{secrets.token_hex(6)}"
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            name_t[:len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
        except OSError as exc:
            err = f"cannot create {path} ({size} bytes): {exc}"
    call = Call("shm_setup", "tree", info, name_t.numel(), torch.uint8)
    mm = None
    try:
        tree.broadcast(call, name_t, 0)
        raw = bytes(name_t.tolist()).rstrip(b"\0").decode()
        path = os.path.join(SHM_DIR, raw) if raw else None
        if path is not None:
            try:
                fd = os.open(path, os.O_RDWR)
                try:
                    mm = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
                mm[r * LINE * 8 + 8:r * LINE * 8 + 16] = os.getpid().to_bytes(8, "little")
            except (OSError, ValueError) as exc:
                err = f"cannot map {path}: {exc} (are all ranks of the group on one host?)"
        ok = torch.tensor([0 if (mm is None or err) else 1], dtype=torch.int64)
        tree.all_reduce(call, ok, "min")  # also the barrier: every rank has mapped it
        call.close()
    finally:
        if r == 0 and path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass
    if not int(ok[0]):
        if mm is not None:
            mm.close()
        raise CommError(f"shared-memory setup for global ranks {list(info.ranks)} on rank "
                        f"{info.global_rank}: {err or 'a peer could not map the segment'}")
    return Segment(mm, info.ranks, r, SLOT_BYTES)


def release() -> None:
    """Unmap every segment of this process (they are already unlinked)."""
    for _, seg in _segments.values():
        try:
            seg.close()
        except BufferError:
            pass
    _segments.clear()
