"""Rank functions of the several-ranks-on-one-GPU tests (``tests/test_gpu.py``): every
collective of ``shardwise.comm`` on CUDA tensors over gloo (``parallel.backend = "gloo"``),
staged through page-locked host buffers, against the same collective on CPU copies."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.base.config import ALL_TO_ALL_ALGORITHMS, ALLREDUCE_ALGORITHMS


def _data(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small integers: every summation order gives the same bits."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype)


def staged_collectives(device: str = "cuda") -> dict:
    """Each collective and algorithm on CUDA and on the CPU; ``bad`` lists the cases where
    the CUDA result differs from the CPU one (or is not on CUDA)."""
    comm.configure(timeout_s=60)  # a hang fails in a minute, naming the collective
    r, n = dist.get_rank(), dist.get_world_size()
    dev = (torch.device("cuda", torch.cuda.current_device()) if device == "cuda"
           else torch.device(device))
    bad, count = [], 0

    def same(key: str, gpu: torch.Tensor, cpu: torch.Tensor) -> None:
        nonlocal count
        count += 1
        if gpu.device != dev:
            bad.append(f"{key}: result on {gpu.device}")
        elif not torch.equal(gpu.cpu(), cpu):
            bad.append(f"{key}: {gpu.reshape(-1)[:4].tolist()} vs {cpu.reshape(-1)[:4].tolist()}")

    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for m in (1, 37, 4099):
            x = _data(m, dtype, 100 * r + m)
            for algo in ALLREDUCE_ALGORITHMS:
                if algo in ("shm", "hierarchical"):  # CPU tensors only
                    continue
                a, b = x.to(dev), x.clone()
                comm.all_reduce(a, algorithm=algo)
                comm.all_reduce(b, algorithm=algo if algo != "auto" else "native")
                same(f"all_reduce/{algo}/{dtype}/{m}", a, b)
            a, b = x.to(dev), x.clone()
            comm.broadcast(a, n - 1)
            comm.broadcast(b, n - 1)
            same(f"broadcast/{dtype}/{m}", a, b)
            a, b = x.to(dev), x.clone()
            comm.reduce(a, 0)
            comm.reduce(b, 0)
            same(f"reduce/{dtype}/{m}", a, b)
            for algo in ("native", "ring", "recursive_doubling"):
                a, b = torch.empty(n * m, dtype=dtype, device=dev), torch.empty(n * m, dtype=dtype)
                comm.all_gather_into_tensor(a, x.to(dev), algorithm=algo)
                comm.all_gather_into_tensor(b, x, algorithm=algo)
                same(f"all_gather/{algo}/{dtype}/{m}", a, b)
            big = _data(n * m, dtype, 7 * r + m)
            for algo in ("native", "ring", "recursive_halving"):
                a, b = torch.empty(m, dtype=dtype, device=dev), torch.empty(m, dtype=dtype)
                comm.reduce_scatter_tensor(a, big.to(dev), algorithm=algo)
                comm.reduce_scatter_tensor(b, big, algorithm=algo)
                same(f"reduce_scatter/{algo}/{dtype}/{m}", a, b)
            rows = [(r + j) % 3 + 1 for j in range(n)]  # uneven splits: r sends rows[j] to j
            theirs = [(j + r) % 3 + 1 for j in range(n)]  # rank j sends (j + r) % 3 + 1 to r
            src = _data(sum(rows) * 2, dtype, 11 * r + m).view(-1, 2)
            for algo in ALL_TO_ALL_ALGORITHMS:
                a = torch.empty(sum(theirs), 2, dtype=dtype, device=dev)
                b = torch.empty(sum(theirs), 2, dtype=dtype)
                comm.all_to_all_single(a, src.to(dev), theirs, rows, algorithm=algo)
                comm.all_to_all_single(b, src, theirs, rows, algorithm=algo)
                same(f"all_to_all/{algo}/{dtype}/{m}", a, b)
    # point to point: a ring of sends in one round, then a blocking send / recv pair
    x = _data(513, torch.float32, r)
    got = torch.empty(513, device=dev)
    comm.exchange(sends=[(x.to(dev), (r + 1) % n)], recvs=[(got, (r - 1) % n)])
    same("exchange", got, _data(513, torch.float32, (r - 1) % n))
    if r == 0:
        comm.send(x.to(dev), n - 1)
    elif r == n - 1:
        got = torch.empty(513, device=dev)
        comm.recv(got, 0)
        same("send/recv", got, _data(513, torch.float32, 0))
    # the argument check runs on CUDA tensors too, and still catches a mismatch
    try:
        comm.all_reduce(torch.ones(3 + (r == 0), device=dev), algorithm="ring", check=True)
        bad.append("mismatched sizes were not caught")
    except comm.CommError as e:
        caught = "different arguments" in str(e)
        if not caught:
            bad.append(f"mismatch: {e}")
    return {"bad": bad, "count": count}
