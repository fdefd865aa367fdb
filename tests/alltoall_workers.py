"""Rank function for tests/test_comm_alltoall.py: one spawn of 4 ranks checks the
all-to-all on the world and on sub-groups of 2 and 3 ranks (uneven group sizes).

Split sizes are drawn from a generator every rank seeds alike, so each rank knows the whole
N x N matrix of rows ``rows[i][j]`` (rank i sends to rank j), zeros and empty inputs
included. Data are small integers tagged with the sender, the receiver and the row, so
results are compared for equality against ``torch.distributed.all_to_all_single``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.comm import accounting

ALGORITHMS = ("native", "pairwise", "linear")


def split_matrix(n: int, seed: int, zero_prob: float = 0.3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(1, 6, (n, n), generator=g)
    rows[torch.rand(n, n, generator=g) < zero_prob] = 0
    return rows.tolist()


def block(sender: int, receiver: int, count: int, width: tuple, dtype) -> torch.Tensor:
    base = 1000 * sender + 100 * receiver
    t = base + torch.arange(count * max(1, int(torch.Size(width).numel()))) % 97
    return t.view(count, *width).to(dtype)


def case(ranks: list[int], group, rows: list[list[int]], width: tuple, dtype, algo: str,
         async_op: bool) -> dict:
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    inp = torch.cat([block(me, j, rows[me][j], width, dtype) for j in range(n)])
    out = torch.full((sum(rows[i][me] for i in range(n)), *width), -1).to(dtype)
    want = torch.cat([block(i, me, rows[i][me], width, dtype) for i in range(n)])
    native = torch.empty_like(want)
    dist.all_to_all_single(native, inp, [rows[i][me] for i in range(n)], rows[me], group=group)
    h = comm.all_to_all_single(out, inp, [rows[i][me] for i in range(n)], rows[me], group=group,
                               algorithm=algo, async_op=async_op)
    if async_op:
        h.wait()
    return {"ok": torch.equal(out, want) and torch.equal(native, want)}


def parity() -> dict:
    """Every algorithm x group x width x dtype x split pattern (x sync / async)."""
    world = dist.get_world_size()
    groups = {n: (list(range(n)), dist.new_group(list(range(n))) if n < world else None)
              for n in (2, 3, world)}
    bad, count = [], 0
    for n, (ranks, group) in groups.items():
        for seed in range(3):
            rows = split_matrix(n, seed)
            if seed == 2:  # everything to the last rank, nothing else
                rows = [[0] * (n - 1) + [3] for _ in range(n)]
            for width in ((), (3,)):
                for dtype in (torch.float32, torch.int64):
                    for algo in ALGORITHMS:
                        if dist.get_rank() not in ranks:
                            continue
                        res = case(ranks, group, rows, width, dtype, algo, async_op=seed == 1)
                        count += 1
                        if not res["ok"]:
                            bad.append((n, seed, width, str(dtype), algo))
    # the list form: any sizes per peer, on the world
    r = dist.get_rank()
    ins = [torch.full((r + j + 1,), float(10 * r + j)) for j in range(world)]
    outs = [torch.empty(i + r + 1) for i in range(world)]
    list_ok = []
    for algo in ALGORITHMS:
        comm.all_to_all(outs, ins, algorithm=algo)
        list_ok.append(all(torch.equal(outs[i], torch.full((i + r + 1,), float(10 * i + r)))
                           for i in range(world)))
    # even blocks (no split sizes)
    x = torch.arange(4 * world, dtype=torch.float32) + 100 * r
    y = torch.empty_like(x)
    comm.all_to_all_single(y, x, algorithm="pairwise")
    even = torch.equal(y, torch.cat([torch.arange(4 * r, 4 * r + 4, dtype=torch.float32)
                                     + 100 * i for i in range(world)]))
    return {"bad": bad, "count": count, "list_ok": list_ok, "even": even}


def records() -> list[dict]:
    """One recorded call per algorithm on the world with the split matrix of seed 7, width
    (5,) float32; returns this rank's records and the matrix."""
    n, r = dist.get_world_size(), dist.get_rank()
    rows = split_matrix(n, 7, zero_prob=0.2)
    inp = torch.ones(sum(rows[r]), 5)
    out = torch.empty(sum(rows[i][r] for i in range(n)), 5)
    with accounting.recording() as rec:
        for algo in ALGORITHMS:
            comm.all_to_all_single(out, inp, [rows[i][r] for i in range(n)], rows[r],
                                   algorithm=algo)
    return {"rows": rows, "records": accounting.table(rec.records)}


def mismatch(timeout_s: float) -> dict:
    """Rank 1 expects one row more from rank 0 than rank 0 sends: every rank raises the same
    kind of CommError (checked), and the group still works after."""
    n, r = dist.get_world_size(), dist.get_rank()
    comm.configure(timeout_s=timeout_s)
    send = [1] * n
    recv = [1] * n
    if r == 1:
        recv[0] = 2
    t0 = time.monotonic()
    try:
        comm.all_to_all_single(torch.empty(sum(recv), 2), torch.zeros(sum(send), 2), recv, send,
                               algorithm="pairwise")
        msg = "no error"
    except comm.CommError as exc:
        msg = str(exc)
    seconds = time.monotonic() - t0
    bad_sizes = ""
    try:
        comm.all_to_all_single(torch.empty(3), torch.zeros(3), [1] * n, [2] * n)
    except ValueError as exc:
        bad_sizes = str(exc)
    y = torch.empty(n)
    comm.all_to_all_single(y, torch.full((n,), float(r)), algorithm="linear")
    return {"msg": msg, "seconds": seconds, "bad_sizes": bad_sizes,
            "still_works": y.tolist() == [float(i) for i in range(n)]}


def bundle() -> dict:
    torch.set_num_threads(1)
    return {"parity": parity(), "records": records(), "mismatch": mismatch(20.0)}
