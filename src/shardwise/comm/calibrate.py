"""Measure the cost model's constants on this machine (``shardwise bench comm --calibrate``).

For each world size N, N ranks are spawned and time four transfer patterns, a local
reduction and the backend's all-reduce, for messages m = 1 MiB .. 64 MiB (the bandwidth
regime the model is for), alternating the patterns within each repeat and taking medians
over repeats that no other process disturbed (``quiet.py``):

- relay: a message of m bytes goes once round the ring, 0 -> 1 -> ... -> N-1 -> 0, one hop
  at a time; each hop waits for the previous one (N steps, one message each). This is a
  one-way message as tree, naive and sequential see it: the receiver waits in a receive,
  the sender has just received or reduced the data. Per hop: alpha + m b(1)  -> beta_link.
- exchange: every rank sends m to its right neighbour while receiving m from its left (one
  step of ring, N messages at once): alpha + m b(N)  -> alpha and beta_host = slope / N
  (the slope is max(beta_link, N beta_host); the host term is the one that binds here).
- add alone: rank 0 runs ``acc.add_(other)`` over m bytes, the others wait -> gamma.
- add all: every rank does so at once -> gamma_host = slope / N.
- the backend's own all-reduce -> native_alpha, native_beta.

Each (alpha, slope) is a least-squares fit of t = alpha + m slope weighted by 1/t (relative
error). The fits use messages of 1 MiB and more: below that, on the 2-vCPU development VM,
gloo's waits show erratic 0.1-2 ms stalls (a plain TCP ping-pong between two processes
takes 15 us there), so small-message times are noise around a latency the model only
roughly captures.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from shardwise.comm import quiet
from shardwise.comm.cost import LinkParams, Profile, host_meta
from shardwise.comm.primitives import Call, configure, group_info

SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
FIT_FROM = 1 << 20  # fit on messages of at least 1 MiB (see the module docstring)
PATTERNS = ("relay", "exchange", "add_alone", "add_all", "native")


def _inner(nbytes: int) -> int:
    return max(1, min(20, (4 << 20) // max(nbytes, 1)))


def calibration_worker(sizes: list[int], repeats: int) -> dict:
    """Run on every rank; per pattern and size, the slowest rank's median (quiet repeats)."""
    configure(check=False)
    info = group_info(None, "calibrate")
    n, r = info.size, info.rank
    pids = quiet.rank_pids()  # collective: every rank
    foreign = quiet.Foreign(pids) if r == 0 else None
    out: dict = {p: {} for p in PATTERNS}
    out["foreign"] = {}
    for m in sizes:
        x, y = torch.ones(m // 4), torch.empty(m // 4)
        a, b = torch.ones(m // 4), torch.ones(m // 4)
        call = Call("calibrate", "pattern", info, m, account=False)

        def relay():
            if r > 0:
                call.exchange(r, recvs=[(r - 1, y)])
            call.exchange(r + 1, sends=[((r + 1) % n, x if r == 0 else y)])
            if r == 0:
                call.exchange(n, recvs=[(n - 1, y)])

        def exchange():
            call.exchange(1, sends=[((r + 1) % n, x)], recvs=[((r - 1) % n, y)])

        def add_alone():
            if r == 0:
                a.add_(b)

        fns = {"relay": relay, "exchange": exchange, "add_alone": add_alone,
               "add_all": lambda: a.add_(b), "native": lambda: dist.all_reduce(x)}
        inner = _inner(m)
        times: dict = {p: [] for p in PATTERNS}

        def one_repeat(i: int) -> None:
            k = i % len(PATTERNS)
            for p in PATTERNS[k:] + PATTERNS[:k]:
                call.deadline = time.monotonic() + 300
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(inner):
                    fns[p]()
                times[p].append((time.perf_counter() - t0) / inner)
                x.fill_(1.0)
                a.fill_(1.0)

        for p in PATTERNS:  # warm-up
            fns[p]()
        loads = quiet.repeat_until_quiet(one_repeat, repeats, 4 * repeats, foreign)
        t = torch.tensor([statistics.median(quiet.quiet_values(times[p], loads))
                          for p in PATTERNS], dtype=torch.float64)
        # the slowest rank's median (each rank times itself; all started by the barrier)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        for p, v in zip(PATTERNS, t.tolist()):
            out[p][m] = v
        out["relay"][m] /= n  # per hop
        out["foreign"][m] = {"tries": len(loads),
                             "quiet": sum(x_ < quiet.THRESHOLD for x_ in loads)}
    return out


def fit_alpha_beta(points: dict[int, float]) -> tuple[float, float]:
    """Weighted least squares of t = alpha + m beta (weights 1/t: relative error)."""
    ms = [float(m) for m in points]
    ts = [points[m] for m in points]
    w = [1.0 / t for t in ts]
    sw = sum(w_ * w_ for w_ in w)
    sx = sum(w_ * w_ * m for w_, m in zip(w, ms))
    sy = sum(w_ * w_ * t for w_, t in zip(w, ts))
    sxx = sum(w_ * w_ * m * m for w_, m in zip(w, ms))
    sxy = sum(w_ * w_ * m * t for w_, m, t in zip(w, ms, ts))
    beta = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    alpha = (sy - beta * sx) / sw
    return max(alpha, 1e-7), max(beta, 1e-13)


def params_from(result: dict, n: int) -> LinkParams:
    """LinkParams from ``calibration_worker``'s result at world size ``n`` (sizes >= FIT_FROM)."""
    def big(points: dict) -> dict:
        return {int(m): t for m, t in points.items() if int(m) >= FIT_FROM}
    _, beta_link = fit_alpha_beta(big(result["relay"]))
    alpha, slope_x = fit_alpha_beta(big(result["exchange"]))
    _, gamma = fit_alpha_beta(big(result["add_alone"]))
    _, slope_g = fit_alpha_beta(big(result["add_all"]))
    n_alpha, n_beta = fit_alpha_beta(big(result["native"]))
    return LinkParams(alpha=alpha, beta_link=beta_link, beta_host=slope_x / n, gamma=gamma,
                      gamma_host=slope_g / n, native_alpha=n_alpha, native_beta=n_beta)


def calibrate(world_sizes: list[int], name: str, repeats: int = 5,
              sizes: list[int] = SIZES, threads: int | None = None) -> tuple[Profile, dict]:
    """Spawn each world size, measure, fit; returns the profile and the raw timings."""
    from shardwise.launch import spawn, threads_per_rank
    params, raw = {}, {}
    for n in world_sizes:
        res = spawn(calibration_worker, n, (sizes, repeats), threads=threads)[0]
        raw[n] = res
        params[n] = params_from(res, n)
    meta = host_meta() | {"created": time.strftime("%Y-%m-%d %H:%M:%S"),
                          "torch": torch.__version__, "sizes": sizes, "repeats": repeats,
                          "threads_per_rank": {n: threads or threads_per_rank(n)
                                               for n in world_sizes}}
    meta["raw_seconds"] = {str(n): {k: {str(m): t for m, t in v.items()}
                                    for k, v in res.items()} for n, res in raw.items()}
    return Profile(name, params, meta), raw
