"""Rank functions for tests/test_comm*.py, run by ``shardwise.launch.spawn``.

Each returns plain data (dicts, lists, numbers, small tensors) that the test compares; many
checks share one spawn because each spawn costs ~1.5 s of start-up.
"""

from __future__ import annotations

import hashlib
import os
import time

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.comm import accounting

DTYPES = (torch.float32, torch.int64, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int8, torch.uint8, torch.bool, torch.complex64)
OUR_ALLREDUCE = ("naive", "sequential", "ring", "halving_doubling", "rabenseifner", "tree",
                 "parallel", "auto")
NATIVE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def ops_for(dtype: torch.dtype) -> list[str]:
    ops = ["sum"]
    if dtype.is_floating_point or dtype.is_complex:
        ops.append("mean")
    if not dtype.is_complex:
        ops += ["max", "min"]
    return ops


def data(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Integer-valued data: sums are exact in every dtype, so any order gives equal bits."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 9, (n,), generator=g).to(dtype)
    if dtype.is_complex:
        return torch.complex(torch.randint(-8, 9, (n,), generator=g).float(),
                             torch.randint(-8, 9, (n,), generator=g).float()).to(dtype)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype)


def native_all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
    out = t.clone()
    dist.all_reduce(out, NATIVE_OPS["sum" if op == "mean" else op])
    if op == "mean":
        out.div_(dist.get_world_size())
    return out


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:12]


def all_reduce_parity(lengths: list[int]) -> dict:
    """Every algorithm x op x dtype x length against dist.all_reduce; digests of results."""
    r = dist.get_rank()
    bad, digests, count = [], {}, 0
    for dtype in DTYPES:
        for op in ops_for(dtype):
            # every length for the first two dtypes, the last (odd) length for the others
            for n in (lengths if dtype in DTYPES[:2] else lengths[-1:]):
                x = data(n, dtype, seed=1000 * r + n)
                want = native_all_reduce(x, op)
                for algo in OUR_ALLREDUCE:
                    got = x.clone()
                    comm.all_reduce(got, op=op, algorithm=algo)
                    count += 1
                    key = f"{algo}/{op}/{str(dtype)[6:]}/{n}"
                    digests[key] = digest(got)
                    if not torch.equal(got, want):
                        bad.append(f"{key}: got {got[:6].tolist()} want {want[:6].tolist()}")
    # non-integer floats: equal to native up to rounding order, identical across ranks
    x = torch.randn(257, generator=torch.Generator().manual_seed(r), dtype=torch.float32)
    want = native_all_reduce(x, "sum")
    for algo in OUR_ALLREDUCE:
        got = x.clone()
        comm.all_reduce(got, algorithm=algo)
        digests[f"{algo}/randn"] = digest(got)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            bad.append(f"{algo}/randn: max diff {(got - want).abs().max().item()}")
    # pipelined ring: chunks cut into many pieces (tiny segment_bytes), odd lengths
    saved = comm.settings.segment_bytes
    for seg in (4, 12, 100):
        comm.configure(segment_bytes=seg)
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            for n in (1, 37, 301):
                for op in ops_for(dtype):
                    x = data(n, dtype, seed=7 * r + n)
                    got = x.clone()
                    comm.all_reduce(got, op=op, algorithm="ring")
                    count += 1
                    key = f"ring-seg{seg}/{op}/{str(dtype)[6:]}/{n}"
                    digests[key] = digest(got)
                    if not torch.equal(got, native_all_reduce(x, op)):
                        bad.append(f"{key}: got {got[:6].tolist()}")
    # pieces are counted as messages; bytes are the plain ring's
    size = dist.get_world_size()
    comm.configure(segment_bytes=16)  # 4 float32 per piece, chunks of 12: 3 pieces
    with accounting.recording() as rec:
        comm.all_reduce(torch.ones(12 * size), algorithm="ring")
    row = accounting.table(rec.records)[-1]
    accounting.reset()  # accounting_records counts every record of the process
    want_row = (2 * (size - 1) * 48, 2 * (size - 1) * 48, 6 * (size - 1), 6 * (size - 1),
                2 * (size - 1), 2 * (size - 1))
    got_row = tuple(row[k] for k in ("bytes_sent", "bytes_recv", "msgs_sent", "msgs_recv",
                                     "steps", "last_step"))
    if got_row != want_row:
        bad.append(f"ring-seg16 accounting: {got_row} != {want_row}")
    comm.configure(segment_bytes=saved)
    # a 2-D non-contiguous tensor, and the native path through our API
    m = data(35, torch.float32, r).reshape(5, 7).t()
    for algo in ("ring", "native"):
        got = m.clone().t().contiguous().t()  # same strides as m
        comm.all_reduce(got, op="mean", algorithm=algo)
        if not torch.equal(got, native_all_reduce(m.contiguous(), "mean")):
            bad.append(f"{algo}/non-contiguous")
    return {"bad": bad, "count": count, "digests": digests}


def other_collectives() -> dict:
    """broadcast, reduce, gather, scatter, all-gather, reduce-scatter vs torch.distributed."""
    r, n = dist.get_rank(), dist.get_world_size()
    bad, count = [], 0

    def expect(key, got, want):
        nonlocal count
        count += 1
        if not torch.equal(got, want):
            bad.append(f"{key}: got {got.reshape(-1)[:6].tolist()} "
                       f"want {want.reshape(-1)[:6].tolist()}")

    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        for m in (1, 5, 37):
            x = data(m, dtype, seed=77 * r + m)
            for root in sorted({0, n - 1, n // 2}):
                want = x.clone(); dist.broadcast(want, root)
                got = x.clone(); comm.broadcast(got, root)
                expect(f"broadcast/{dtype}/{m}/{root}", got, want)
                for op in ops_for(dtype):
                    want = x.clone(); dist.reduce(want, root, NATIVE_OPS["sum" if op == "mean" else op])
                    if op == "mean" and r == root:
                        want.div_(n)
                    got = x.clone(); comm.reduce(got, root, op=op)
                    expect(f"reduce/{op}/{dtype}/{m}/{root}", got if r == root else got,
                           want if r == root else x)
                wl = [torch.empty_like(x) for _ in range(n)] if r == root else None
                gl = [torch.empty_like(x) for _ in range(n)] if r == root else None
                dist.gather(x, wl, dst=root); comm.gather(x, gl, dst=root)
                if r == root:
                    expect(f"gather/{dtype}/{m}/{root}", torch.stack(gl), torch.stack(wl))
                parts = [data(m, dtype, seed=5 * i + m) for i in range(n)] if r == root else None
                want, got = torch.empty_like(x), torch.empty_like(x)
                dist.scatter(want, parts, src=root); comm.scatter(got, parts, src=root)
                expect(f"scatter/{dtype}/{m}/{root}", got, want)
            wl = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(wl, x)
            for algo in ("ring", "recursive_doubling", "native"):
                out = torch.empty(n * m, dtype=dtype)
                comm.all_gather_into_tensor(out, x, algorithm=algo)
                expect(f"all_gather/{algo}/{dtype}/{m}", out, torch.cat(wl))
                gl = [torch.empty_like(x) for _ in range(n)]
                comm.all_gather(gl, x, algorithm=algo)
                expect(f"all_gather_list/{algo}/{dtype}/{m}", torch.stack(gl), torch.stack(wl))
            big = data(n * m, dtype, seed=31 * r + m)
            for op in ops_for(dtype):
                full = native_all_reduce(big, op)
                want = full[r * m:(r + 1) * m]
                for algo in ("ring", "recursive_halving", "native"):
                    out = torch.empty(m, dtype=dtype)
                    before = big.clone()
                    comm.reduce_scatter_tensor(out, big, op=op, algorithm=algo)
                    expect(f"reduce_scatter/{algo}/{op}/{dtype}/{m}", out, want)
                    expect(f"reduce_scatter_input/{algo}/{op}/{dtype}/{m}", big, before)
    return {"bad": bad, "count": count}


def async_and_p2p() -> dict:
    """Async handles in flight together; sync calls keep order; send/recv; barrier."""
    r, n = dist.get_rank(), dist.get_world_size()
    xs = [data(50 + i, torch.float32, seed=r * 10 + i) for i in range(6)]
    wants = [native_all_reduce(x, "sum") for x in xs]
    algos = ["ring", "tree", "halving_doubling", "native", "auto", "naive"]
    outs = [x.clone() for x in xs]
    handles = [comm.all_reduce(o, algorithm=a, async_op=True) for o, a in zip(outs, algos)]
    mid = data(9, torch.float32, seed=r)
    comm.all_reduce(mid, algorithm="ring")  # sync call while async ones are queued
    handles.append(comm.broadcast(outs[0], 0, async_op=True))
    ok = [h.wait() for h in handles]
    same = [torch.equal(o, w) for o, w in zip(outs, wants)]
    token = torch.tensor([float(r)])
    if r == 0:
        for dst in range(1, n):
            comm.send(token + dst, dst)
        got = token
    else:
        got = torch.empty(1)
        comm.recv(got, 0)
    # async p2p: rank 0 posts all its sends before waiting; a non-contiguous receive buffer
    if r == 0:
        sends = [comm.send(torch.full((4,), float(d)), d, async_op=True) for d in range(1, n)]
        async_p2p = all(h.wait() for h in sends)
    else:
        buf = torch.zeros(4, 2)[:, 1]
        h = comm.recv(buf, 0, async_op=True)
        async_p2p = h.wait() and torch.equal(buf, torch.full((4,), float(r)))
    # batched exchange around the ring, sync then async
    right, left = (r + 1) % n, (r - 1) % n
    prev, prev2 = torch.empty(3), torch.empty(3)
    comm.exchange([(torch.full((3,), float(r)), right)], [(prev, left)])
    h = comm.exchange([(torch.full((3,), 2.0 * r), right)], [(prev2, left)], async_op=True)
    exchanged = h.wait() and torch.equal(prev, torch.full((3,), float(left))) and \
        torch.equal(prev2, torch.full((3,), 2.0 * left))
    comm.barrier()
    comm.shutdown()  # the thread stops; the next async call starts it again
    h = comm.all_reduce(torch.ones(3), algorithm="ring", async_op=True)
    h.wait()
    return {"waits": ok, "same": same, "mid": torch.equal(mid, native_all_reduce(
        data(9, torch.float32, seed=r), "sum")), "p2p": got.item(), "done": h.is_completed(),
        "async_p2p": bool(async_p2p), "exchange": bool(exchanged)}


def accounting_records(numels: list[int]) -> list[dict]:
    """One call of every algorithm per length, recorded; returns this rank's records."""
    r, n = dist.get_rank(), dist.get_world_size()
    with accounting.recording() as rec:
        for m in numels:
            x = torch.ones(m)
            for algo in ("naive", "sequential", "ring", "halving_doubling", "tree", "parallel",
                         "native"):
                comm.all_reduce(x.clone(), algorithm=algo)
            comm.broadcast(x.clone(), n - 1)
            comm.reduce(x.clone(), 0)
            out = torch.empty(n * m)
            for algo in ("ring", "recursive_doubling"):
                comm.all_gather_into_tensor(out, x, algorithm=algo)
            for algo in ("ring", "recursive_halving"):
                comm.reduce_scatter_tensor(x.clone(), out, algorithm=algo)
            comm.gather(x, [torch.empty(m) for _ in range(n)] if r == 0 else None, dst=0)
            comm.scatter(x.clone(), [x] * n if r == 0 else None, src=0)
    assert not accounting.log.enabled
    comm.all_reduce(torch.ones(3), algorithm="ring")  # not recorded: accounting is off again
    return accounting.table(rec.records) + [{"total_records": len(accounting.log.records)}]


def parity_and_accounting(lengths: list[int], dtypes: list[str], acct_numels: list[int]) -> dict:
    """The per-world-size bundle of test_comm_parity.py: one spawn, many checks."""
    global DTYPES
    DTYPES = tuple(getattr(torch, d) for d in dtypes)
    t0 = time.perf_counter()
    out = {"all_reduce": all_reduce_parity(lengths), "other": other_collectives(),
           "async": async_and_p2p(), "records": accounting_records(acct_numels)}
    out["seconds"] = time.perf_counter() - t0
    return out


def _error_of(fn) -> str:
    try:
        fn()
    except comm.CommTimeoutError as exc:
        return "timeout: " + str(exc)
    except comm.CommError as exc:
        return "error: " + str(exc)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _absent(timeout_s: float, flags_dir: str | None, waiters: range) -> None:
    """The absent rank: never calls the collective; stays away until every rank of
    ``waiters`` has given up (each writes ``flags_dir/gave_up.<rank>`` after its timeout
    error), at most ``timeout_s + 2`` s (without ``flags_dir``: exactly that long)."""
    deadline = time.monotonic() + timeout_s + 2.0
    flags = [] if flags_dir is None else [os.path.join(flags_dir, f"gave_up.{w}") for w in waiters]
    while time.monotonic() < deadline:
        if flags and all(os.path.exists(f) for f in flags):
            return
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def _gave_up(flags_dir: str | None) -> None:
    if flags_dir is not None:
        with open(os.path.join(flags_dir, f"gave_up.{dist.get_rank()}"), "w"):
            pass


def bad_input(timeout_s: float, flags_dir: str | None = None) -> dict:
    """Each misuse must raise, naming the collective and the rank, and never hang."""
    r, n = dist.get_rank(), dist.get_world_size()
    comm.configure(timeout_s=timeout_s)
    out = {}
    out["shape"] = _error_of(lambda: comm.all_reduce(torch.ones(10 + r), algorithm="ring"))
    x = torch.ones(6, dtype=torch.float32 if r else torch.int32)
    out["dtype"] = _error_of(lambda: comm.all_reduce(x, algorithm="tree"))
    y = torch.ones(4)
    out["mixed"] = _error_of(lambda: comm.all_reduce(y) if r == 0 else comm.broadcast(y, 0))
    sub = dist.new_group([0, 1])
    out["not_member"] = _error_of(lambda: comm.all_reduce(torch.ones(3), group=sub,
                                                          algorithm="ring"))
    out["src_outside"] = _error_of(lambda: comm.broadcast(torch.ones(3), n - 1, group=sub)
                                   if r < 2 else None)
    out["bad_op"] = _error_of(lambda: comm.all_reduce(torch.ones(3), op="prod"))
    out["mean_int"] = _error_of(lambda: comm.all_reduce(torch.ones(3, dtype=torch.int32),
                                                        op="mean"))
    out["bad_algo"] = _error_of(lambda: comm.all_reduce(torch.ones(3), algorithm="butterfly"))
    # after all that, the group still works
    z = torch.full((5,), float(r))
    comm.all_reduce(z, algorithm="halving_doubling")
    out["still_works"] = z.tolist()
    # a rank that never arrives: rank 0 stays away past the timeout instead of calling
    t0 = time.monotonic()
    if r == 0:
        _absent(timeout_s, flags_dir, range(1, n))
        out["absent"] = "slept"
    else:
        out["absent"] = _error_of(lambda: comm.all_reduce(torch.ones(3), algorithm="ring"))
        _gave_up(flags_dir)
    out["absent_s"] = time.monotonic() - t0
    return out


def absent_unchecked(timeout_s: float, flags_dir: str | None = None) -> dict:
    """Same with the argument check off: the algorithm's own receive times out."""
    r = dist.get_rank()
    comm.configure(timeout_s=timeout_s, check=False)
    t0 = time.monotonic()
    if r == 0:
        _absent(timeout_s, flags_dir, range(1, dist.get_world_size()))
        msg = "slept"
    else:
        handle = comm.all_reduce(torch.ones(3), algorithm="ring", async_op=True)
        msg = _error_of(handle.wait)
        _gave_up(flags_dir)
    return {"absent": msg, "seconds": time.monotonic() - t0}


# ---------------------------------------------------------------------------- test-side cache

# world size -> (lengths, dtypes) of the parity bundle; 8 ranks share 2 cores, so fewer dtypes
PARITY_PLAN = {
    2: ([0, 1, 3, 37], [str(d)[6:] for d in DTYPES]),
    3: ([0, 1, 2, 37], [str(d)[6:] for d in DTYPES]),
    4: ([0, 1, 3, 37], [str(d)[6:] for d in DTYPES]),
    5: ([1, 4, 37], ["float32", "int64", "float16", "bfloat16", "uint8", "bool"]),
    8: ([1, 7, 37], ["float32", "int64", "bfloat16", "bool"]),
}
ACCT_NUMELS = [840, 37]  # 840 = lcm(1..8): divides by every world size; 37 does not
_bundles: dict[int, list] = {}


def bundle(world_size: int) -> list:
    """The results of ``parity_and_accounting`` on each rank, spawned once per world size."""
    if world_size not in _bundles:
        from shardwise.launch import spawn
        lengths, dtypes = PARITY_PLAN[world_size]
        _bundles[world_size] = spawn(parity_and_accounting, world_size,
                                     (lengths, dtypes, ACCT_NUMELS), join_timeout_s=600)
    return _bundles[world_size]
