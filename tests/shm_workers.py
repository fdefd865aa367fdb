"""Rank functions for tests/test_comm_shm.py: the shared-memory and hierarchical paths.

One spawn per world size runs every check (``suite``); the slot is cut to 4 KiB so that
every length above a few hundred elements takes several rounds (the double-buffered sets
alternate, pieces are uneven).
"""

from __future__ import annotations

import os
import signal
import time
import zlib

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.comm import accounting, api, hierarchical, shm_segment
from shardwise.comm.primitives import balanced_bounds, combine_into, group_info

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
          torch.uint8, torch.bool)
LENGTHS = (1, 1000, 4099)  # 1: empty regions; 4099: prime, several rounds of a 4 KiB slot
SLOT = 4096
NATIVE = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
          "min": dist.ReduceOp.MIN}


def ops_for(dtype: torch.dtype) -> list[str]:
    return ["sum", "max", "min"] + (["mean"] if dtype.is_floating_point else [])


def ints(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small integers: every summation order gives the same bits, so equal to native."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    lo = 0 if dtype == torch.uint8 else -8
    return torch.randint(lo, 9, (n,), generator=g).to(dtype)


def floats(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random floats: rounding depends on the order, compared with the rank-order sum."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rank_order(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """((x_0 op x_1) op x_2) ...: the order the shared-memory reduction uses."""
    acc = xs[0].clone()
    for x in xs[1:]:
        combine_into(acc, x, acc, op)
    if op == "mean":
        acc.div_(len(xs))
    return acc


_local = [0]  # ranks per fake host (the hierarchical checks)


def host_order(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The hierarchical order on two hosts: each host's rank-order reduction, then one
    combine of the two (a two-rank ring adds each chunk once; ``op`` commutes)."""
    red = "sum" if op == "mean" else op
    local = _local[0]
    a, b = rank_order(xs[:local], red), rank_order(xs[local:], red)
    combine_into(a, b, a, red)
    if op == "mean":
        a.div_(len(xs))
    return a


def native_all_reduce(t: torch.Tensor, op: str, group=None) -> torch.Tensor:
    out = t.clone()
    dist.all_reduce(out, NATIVE[op], group=group)
    if op == "mean":
        out.div_(dist.get_world_size(group))
    return out


def _parity(algorithm: str) -> dict:
    """all_reduce(algorithm) against native (integers: equal) and, for random floats, equal
    to the reference that sums in the algorithm's order (``rank_order`` / ``host_order``;
    gloo's own order is its ring's, so random floats differ from it in the last bits)."""
    n, r = dist.get_world_size(), dist.get_rank()
    bad, count, digests = [], 0, {}
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for m in LENGTHS:
                seed = zlib.crc32(f"{dtype} {op} {m}".encode()) % 10000
                x = ints(m, dtype, seed + r)
                y = x.clone()
                comm.all_reduce(y, op=op, algorithm=algorithm)
                want = native_all_reduce(x, op)
                ok = torch.equal(y, want)
                count += 1
                if not ok:
                    bad.append(f"ints {dtype} {op} {m}")
                if dtype.is_floating_point:
                    xs = [floats(m, dtype, seed + k) for k in range(n)]
                    z = xs[r].clone()
                    comm.all_reduce(z, op=op, algorithm=algorithm)
                    ref = rank_order(xs, op) if algorithm == "shm" else host_order(xs, op)
                    if not torch.equal(z, ref):
                        bad.append(f"floats {dtype} {op} {m}")
                    digests[f"{dtype} {op} {m}"] = z.view(-1).view(torch.uint8).tolist()[:64]
                    count += 1
    return {"bad": bad, "count": count, "digests": digests}


def _sharded() -> dict:
    """reduce_scatter_tensor, all_gather_into_tensor, broadcast and barrier on shm."""
    n, r = dist.get_world_size(), dist.get_rank()
    bad, count = [], 0
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.float64):
        for m in (1, 5, 1500):
            for op in ("sum", "max") + (("mean",) if dtype.is_floating_point else ()):
                x = ints(n * m, dtype, 7 * m + r)
                out, want = torch.empty(m, dtype=dtype), torch.empty(m, dtype=dtype)
                comm.reduce_scatter_tensor(out, x, op=op, algorithm="shm")
                dist.reduce_scatter_tensor(want, x.clone(), NATIVE[op])
                if op == "mean":
                    want.div_(n)
                bad += [] if torch.equal(out, want) else [f"reduce_scatter {dtype} {op} {m}"]
                if dtype.is_floating_point:  # random floats: bit-equal to the rank order
                    xs = [floats(n * m, dtype, 11 * m + k) for k in range(n)]
                    comm.reduce_scatter_tensor(out, xs[r], op=op, algorithm="shm")
                    ref = rank_order(xs, op)[r * m:(r + 1) * m]
                    bad += [] if torch.equal(out, ref) else [f"rs floats {dtype} {op} {m}"]
                count += 1
            x = ints(m, dtype, 3 * m + r)
            got, want = torch.empty(n * m, dtype=dtype), torch.empty(n * m, dtype=dtype)
            comm.all_gather_into_tensor(got, x, algorithm="shm")
            dist.all_gather_into_tensor(want, x)
            bad += [] if torch.equal(got, want) else [f"all_gather {dtype} {m}"]
            for root in range(n):
                b = ints(m, dtype, 100 + root) if r == root else torch.zeros(m, dtype=dtype)
                comm.broadcast(b, root, algorithm="shm")
                want = ints(m, dtype, 100 + root)
                bad += [] if torch.equal(b, want) else [f"broadcast {dtype} {m} root {root}"]
            count += 2
    # a non-contiguous tensor and an async handle
    t = ints(3 * 8, torch.float32, r).view(3, 8).t()
    want = native_all_reduce(t.contiguous(), "sum")
    comm.all_reduce(t, algorithm="shm", async_op=True).wait()
    bad += [] if torch.equal(t, want) else ["non-contiguous async"]
    comm.barrier(algorithm="shm")
    return {"bad": bad, "count": count}


def expected_all_reduce_bytes(m: int, esz: int, n: int, r: int, slot: int) -> dict:
    """What ``shm.all_reduce`` must record on group rank r (see the shm module docstring)."""
    b = balanced_bounds(m, n)
    lens = [b[i + 1] - b[i] for i in range(n)]
    sent = (m - lens[r]) + lens[r]
    recv = (n - 1) * lens[r] + (m - lens[r])
    steps = 2 * max(1, -(-max(lens) // (slot // esz // n)))
    return {"bytes_sent": sent * esz, "bytes_recv": recv * esz, "steps": steps}


def _accounting() -> dict:
    n, r = dist.get_world_size(), dist.get_rank()
    rows = []
    for m, dtype in ((1001, torch.float32), (4099, torch.float64), (7, torch.bfloat16)):
        with accounting.recording() as rec:
            comm.all_reduce(torch.ones(m, dtype=dtype), algorithm="shm")
        (rec1,) = [x for x in rec.records if x.collective == "all_reduce"]
        rows.append({"got": {k: getattr(rec1, k) for k in ("bytes_sent", "bytes_recv", "steps")},
                     "want": expected_all_reduce_bytes(m, torch.empty(0, dtype=dtype)
                                                       .element_size(), n, r, SLOT)})
    with accounting.recording() as rec:
        out = torch.empty(10)
        comm.reduce_scatter_tensor(out, torch.ones(10 * n), algorithm="shm")
    (rs,) = [x for x in rec.records if x.collective == "reduce_scatter"]
    rows.append({"got": [rs.bytes_sent, rs.bytes_recv],
                 "want": [(n - 1) * 10 * 4, (n - 1) * 10 * 4]})
    return {"rows": rows}


def suite(hosts_of: int = 0) -> dict:
    """Every shm check at this world size. ``hosts_of`` > 0: ranks are given fake hosts of
    that many ranks (SHARDWISE_HOST_ID) and the hierarchical path is checked as well."""
    r = dist.get_rank()
    shm_segment.SLOT_BYTES = SLOT
    out = {}
    if hosts_of:
        os.environ["SHARDWISE_HOST_ID"] = f"fake-host-{r // hosts_of}"
        _local[0] = hosts_of
        info = group_info(None, "test")
        lay = hierarchical.layout(info)
        out["hosts"] = [list(h) for h in lay.hosts]
        out["hier"] = _parity("hierarchical")
        out["hier_acct"] = _hier_accounting(hosts_of)
        out["auto"] = [api.choose(info, torch.empty(m)) for m in (1024, 4 << 20)]
        return out
    out["shm"] = _parity("shm")
    out["sharded"] = _sharded()
    out["acct"] = _accounting()
    info = group_info(None, "test")
    out["auto"] = [api.choose(info, torch.empty(m)) for m in (1024, 4 << 20)]
    t = torch.full((1024,), float(r))
    comm.all_reduce(t, algorithm="auto")
    out["auto_value"] = float(t[0])
    return out


def _hier_accounting(local: int) -> dict:
    n, r = dist.get_world_size(), dist.get_rank()
    hosts, lr = n // local, r % local
    m = 1001
    with accounting.recording() as rec:
        comm.all_reduce(torch.ones(m), algorithm="hierarchical")
    (c,) = [x for x in rec.records if x.collective == "all_reduce"]
    b = balanced_bounds(m, local)
    lens = [b[i + 1] - b[i] for i in range(local)]
    # shm: reduce-scatter sends m - own, receives (L-1) own; all-gather sends own, receives m - own
    sent = (m - lens[lr]) + lens[lr]
    recv = (local - 1) * lens[lr] + (m - lens[lr])
    cb = balanced_bounds(lens[lr], hosts)  # ring on the slice: every chunk but two per phase
    h = r // local
    sent += (lens[lr] - (cb[(h + 1) % hosts + 1] - cb[(h + 1) % hosts])) * (hosts > 1)
    sent += (lens[lr] - (cb[(h + 2) % hosts + 1] - cb[(h + 2) % hosts])) * (hosts > 1)
    recv += (lens[lr] - (cb[h + 1] - cb[h])) + (lens[lr] - (cb[(h + 1) % hosts + 1]
                                                           - cb[(h + 1) % hosts]))
    return {"got": [c.bytes_sent, c.bytes_recv], "want": [sent * 4, recv * 4]}


def killed_peer(timeout_s: float, stall_s: float) -> dict:
    """Rank N-1 first stalls (alive, ``stall_s``) then kills itself (SIGKILL) before an
    all-reduce; the others report the errors they get and how long each took."""
    n, r = dist.get_world_size(), dist.get_rank()
    comm.configure(timeout_s=timeout_s, check=False)
    x = torch.ones(1 << 16)
    for _ in range(3):
        comm.all_reduce(x, algorithm="shm")
    if r == n - 1:
        time.sleep(stall_s)
        os.kill(os.getpid(), signal.SIGKILL)
    out = {"pid0": os.getpid() if r == 0 else -1}
    for phase in ("stalled", "killed"):
        t0 = time.monotonic()
        try:
            comm.all_reduce(x, algorithm="shm")
            out[phase] = ["no error", time.monotonic() - t0]
        except comm.CommError as exc:
            out[phase] = [f"{type(exc).__name__}: {exc}", time.monotonic() - t0]
    return out
