"""Small-message latency at N=2: raw gloo send/recv rounds against our all-reduces and gloo's.

For each size, every repeat times (in alternating order) ``--inner`` back-to-back calls of:
a raw gloo exchange round (``dist.isend`` + ``dist.irecv`` of X/2 each way, both waited: the
step ring and halving-doubling are made of), two such rounds (what a ring all-reduce at N=2
must do), our ``ring``, ``halving_doubling`` and ``tree`` all-reduces and gloo's own
``all_reduce``. Prints the median, min and max over repeats of the mean time per call, in
microseconds (rank 0's clock; ranks start each timing after a barrier).

    .venv/bin/python benchmarks/small_message_latency.py --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.launch import spawn


def _cases(x: torch.Tensor, peer: int) -> dict:
    half = x.numel() // 2
    recv = torch.empty(half)

    def round_():
        works = [dist.irecv(recv, peer), dist.isend(x[:half], peer)]
        for w in works:
            w.wait()

    return {
        "raw round X/2": round_,
        "raw 2 rounds": lambda: (round_(), round_()),
        "ring": lambda: comm.all_reduce(x, algorithm="ring", check=False),
        "halving_doubling": lambda: comm.all_reduce(x, algorithm="halving_doubling", check=False),
        "tree": lambda: comm.all_reduce(x, algorithm="tree", check=False),
        "gloo all_reduce": lambda: dist.all_reduce(x),
    }


def _run(sizes: list[int], repeats: int, inner: int) -> dict:
    peer = 1 - dist.get_rank()
    out: dict = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        cases = _cases(x, peer)
        times = {name: [] for name in cases}
        for rep in range(repeats + 1):  # repeat 0 warms up
            for name in (list(cases) if rep % 2 else list(cases)[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(inner):
                    cases[name]()
                if rep:
                    times[name].append((time.perf_counter() - t0) / inner * 1e6)
        out[nbytes] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4 << 10, 64 << 10, 1 << 20])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--inner", type=int, default=20)
    a = ap.parse_args()
    res = spawn(_run, 2, (a.sizes, a.repeats, a.inner), threads=1)[0]
    print(f"N=2 gloo on 127.0.0.1, 1 thread per rank; mean us per call, median [min..max] of "
          f"{a.repeats} alternated repeats of {a.inner} calls")
    for nbytes, times in res.items():
        print(f"\n{nbytes >> 10} KiB")
        for name, ts in times.items():
            print(f"  {name:18} {statistics.median(ts):8.0f}  [{min(ts):.0f}..{max(ts):.0f}]")


if __name__ == "__main__":
    main()
