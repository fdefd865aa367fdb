"""Shared-memory transport for the ranks of one host: reduce-scatter, all-gather, broadcast,
barrier, and all-reduce as reduce-scatter + all-gather.

The design of the intra-node paths of NCCL (SHM transport), oneCCL and DeepSpeed's CPU
``shm_comm``: every rank of the group maps one segment; a collective is a sequence of
*rounds*, and in each round every rank copies what its peers need into its own slot, raises
its sequence number in the segment, waits until every peer's number has reached the same
value, then reads its peers' slots. No message goes through the backend once the segment
exists; the only synchronisation is the sequence numbers.

Layout (bytes): one 64-byte control line per group rank (int64 [0]: rounds completed, [1]:
pid, [2]: a peer sleeps on [0]), padded to 4 KiB, then two *sets* of N slots of
``SLOT_BYTES`` each. A round writes the set that does not hold the previous round's data, so
a rank may write round k+1 while a slow peer still reads round k; it can write that set
again (round k+2) only after every peer arrived at round k+1, that is after every peer
finished reading round k.

Reduce-scatter of a flat buffer cut into N regions (``bounds``): each round carries one
piece of every region; rank r publishes the pieces of the regions i != r, and reduces
region r as ``((x_0 op x_1) op x_2) ...`` in group-rank order, in cache-sized chunks (so the
same bits on every rank and for every element, whoever reduces it). All-gather: rank r
publishes its region's piece, every rank copies the others'. Broadcast: the root publishes.
All-reduce fuses the two: the reduced piece goes from the cache straight to the buffer and
to the unused place of region r in rank r's slot (the same set: it holds inputs of regions
i != r only), then a second round and every rank copies the others' results; per rank this
moves about 4 X bytes through memory at N = 2 where reduce-scatter + all-gather move 4.5 X.

Bytes (accounting): ``bytes_sent`` are the bytes a rank copies into its slot for its peers,
``bytes_recv`` the bytes it reads from its peers' slots (its own contribution is read from
its private buffer and not counted); a message is one region piece, a step is one round.
All-reduce of X bytes on N ranks (N | numel): sent (N-1)/N X + X/N = X, received
2 (N-1)/N X, in 2 ceil(X / SLOT_BYTES) rounds (``rounds``).

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

from shardwise.comm.primitives import (Call, CommError, GroupInfo, balanced_bounds,
                                       combine_into, finish_)

SHM_DIR = "/dev/shm"
PREFIX = "shardwise-shm-"
LINE = 8                      # int64 words per control line (64 bytes)
HEADER_ALIGN = 4096
# per rank and set; of 2, 4, 8, 16 MiB, 8 was the fastest at 64 MiB, N = 2 (2 busy cores)
SLOT_BYTES = int(os.environ.get("SHARDWISE_SHM_SLOT_BYTES", 8 << 20))
CHUNK_BYTES = 256 << 10       # reduction chunk: the accumulator stays in L2
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
        t = self._tmp.get(dtype)
        if t is None:
            t = self._tmp[dtype] = torch.empty(CHUNK_BYTES // torch.empty(0, dtype=dtype)
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


def segment(info: GroupInfo, parent: GroupInfo | None = None) -> Segment:
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


# ---------------------------------------------------------------------------- algorithms

def _count(call: Call, step: int, nbytes: int, sent: bool) -> None:
    if call.record is not None and nbytes:
        call.record.add_message(step, nbytes, sent)


def _reduce(srcs: list[torch.Tensor], dst: torch.Tensor, op: str, tmp: torch.Tensor,
            direct: bool, div: int = 0, also: torch.Tensor | None = None) -> None:
    """dst <- ((srcs[0] op srcs[1]) op srcs[2]) ..., chunk by chunk. ``direct``: dst may be
    written before the last source is read (dst is none of srcs[2:]). ``div``: then divide
    by it; ``also``: copy each finished chunk there too, while it is in the cache."""
    numel, c = dst.numel(), tmp.numel()
    for a in range(0, numel, c):
        b = min(numel, a + c)
        acc = dst[a:b] if direct else tmp[:b - a]
        if len(srcs) == 1:
            acc.copy_(srcs[0][a:b])
        else:
            combine_into(srcs[0][a:b], srcs[1][a:b], acc, op)
        for s in srcs[2:]:
            combine_into(acc, s[a:b], acc, op)
        if div:
            acc.div_(div)
        if not direct:
            dst[a:b].copy_(acc)
        if also is not None:
            also[a:b].copy_(acc)


def reduce_scatter(seg: Segment, call: Call, buf: torch.Tensor, bounds: list[int], op: str,
                   finish_n: int | None = None, step0: int = 0) -> int:
    """Region r of ``buf`` (flat, ``bounds`` as ``ring.reduce_scatter``) on group rank r
    becomes the reduction of every rank's region r; other regions are left as they were.
    ``finish_n``: divide the result by it for "mean" (None: not here). Returns the last step."""
    n, r, esz = seg.n, seg.rank, buf.element_size()
    lens = [bounds[i + 1] - bounds[i] for i in range(n)]
    width = seg.slot // esz // n
    pieces = max(1, -(-max(lens) // width))
    cuts = [balanced_bounds(m, pieces) for m in lens]
    tmp = seg.tmp(buf.dtype)
    step = step0
    for j in range(pieces):
        slots = seg.slots(buf.dtype)
        mine = slots[r]
        step += 1
        for i in range(n):
            a, b = cuts[i][j], cuts[i][j + 1]
            if i != r and b > a:
                mine[i * width:i * width + b - a].copy_(buf[bounds[i] + a:bounds[i] + b])
                _count(call, step, (b - a) * esz, True)
        seg.round(call, step)
        a, b = cuts[r][j], cuts[r][j + 1]
        if b > a:
            own = buf[bounds[r] + a:bounds[r] + b]
            srcs = [own if k == r else slots[k][r * width:r * width + b - a] for k in range(n)]
            _reduce(srcs, own, op, tmp, direct=r < 2)
            for k in range(n):
                if k != r:
                    _count(call, step, (b - a) * esz, False)
    if finish_n is not None:
        finish_(buf[bounds[r]:bounds[r + 1]], op, finish_n)
    return step


def all_gather(seg: Segment, call: Call, buf: torch.Tensor, bounds: list[int],
               step0: int = 0) -> int:
    """Region r of ``buf`` valid on group rank r -> every region valid everywhere."""
    n, r, esz = seg.n, seg.rank, buf.element_size()
    lens = [bounds[i + 1] - bounds[i] for i in range(n)]
    width = seg.slot // esz
    pieces = max(1, -(-max(lens) // width))
    cuts = [balanced_bounds(m, pieces) for m in lens]
    step = step0
    for j in range(pieces):
        slots = seg.slots(buf.dtype)
        step += 1
        a, b = cuts[r][j], cuts[r][j + 1]
        if b > a:
            slots[r][:b - a].copy_(buf[bounds[r] + a:bounds[r] + b])
            _count(call, step, (b - a) * esz, True)
        seg.round(call, step)
        for k in range(n):
            a, b = cuts[k][j], cuts[k][j + 1]
            if k != r and b > a:
                buf[bounds[k] + a:bounds[k] + b].copy_(slots[k][:b - a])
                _count(call, step, (b - a) * esz, False)
    return step


def all_reduce(seg: Segment, call: Call, buf: torch.Tensor, op: str) -> int:
    """Fused reduce-scatter + all-gather over ``balanced_bounds(numel, N)`` (see the module
    docstring). Every element is reduced in group-rank order by one rank and copied: all
    ranks end bitwise identical. Returns the number of rounds."""
    n, r, esz = seg.n, seg.rank, buf.element_size()
    plan = seg.plans.get((buf.numel(), esz))
    if plan is None:
        bounds = balanced_bounds(buf.numel(), n)
        lens = [bounds[i + 1] - bounds[i] for i in range(n)]
        width = seg.slot // esz // n
        pieces = max(1, -(-max(lens) // width))
        plan = (bounds, width, pieces, [balanced_bounds(m, pieces) for m in lens])
        if len(seg.plans) < 256:
            seg.plans[buf.numel(), esz] = plan
    bounds, width, pieces, cuts = plan
    tmp = seg.tmp(buf.dtype)
    step = 0
    for j in range(pieces):
        slots = seg.slots(buf.dtype)
        mine = slots[r]
        step += 1
        for i in range(n):
            a, b = cuts[i][j], cuts[i][j + 1]
            if i != r and b > a:
                mine[i * width:i * width + b - a].copy_(buf[bounds[i] + a:bounds[i] + b])
                _count(call, step, (b - a) * esz, True)
        seg.round(call, step)
        a, b = cuts[r][j], cuts[r][j + 1]
        if b > a:
            own = buf[bounds[r] + a:bounds[r] + b]
            srcs = [own if k == r else slots[k][r * width:r * width + b - a] for k in range(n)]
            res = mine[r * width:r * width + b - a]
            _reduce(srcs, res, op, tmp, direct=True, div=n if op == "mean" else 0, also=own)
            _count(call, step + 1, (b - a) * esz, True)
            for k in range(n):
                if k != r:
                    _count(call, step, (b - a) * esz, False)
        step += 1
        seg.round(call, step, keep=True)
        for k in range(n):
            a, b = cuts[k][j], cuts[k][j + 1]
            if k != r and b > a:
                buf[bounds[k] + a:bounds[k] + b].copy_(slots[k][k * width:k * width + b - a])
                _count(call, step, (b - a) * esz, False)
    return step


def broadcast(seg: Segment, call: Call, buf: torch.Tensor, root: int) -> int:
    """Copy ``buf`` of group rank ``root`` to every rank, piece by piece through its slot."""
    esz, width = buf.element_size(), seg.slot // buf.element_size()
    cut = balanced_bounds(buf.numel(), max(1, -(-buf.numel() // width)))
    step = 0
    for a, b in zip(cut[:-1], cut[1:]):
        slot = seg.slots(buf.dtype)[root]
        step += 1
        if seg.rank == root:
            slot[:b - a].copy_(buf[a:b])
            _count(call, step, (b - a) * esz, True)
        seg.round(call, step)
        if seg.rank != root:
            buf[a:b].copy_(slot[:b - a])
            _count(call, step, (b - a) * esz, False)
    return step


def barrier(seg: Segment, call: Call) -> int:
    seg.round(call, 1)
    return 1


def rounds(numel: int, esz: int, n: int, slot_bytes: int = SLOT_BYTES) -> int:
    """Rounds of an all-reduce of ``numel`` elements on N ranks (the cost model's count)."""
    return 2 * max(1, -(-(-(-numel // n)) // (slot_bytes // esz // n)))
