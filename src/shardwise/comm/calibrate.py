"""Measure the cost model's constants on this machine (``shardwise bench comm --calibrate``).

For each world size N, N ranks are spawned and time, with medians of alternated repeats:

- exchange rounds (every rank sends m bytes to its right neighbour while receiving m from its
  left, the step of ring and halving-doubling) -> alpha and beta_x, by least squares on
  t = alpha + m beta_x over m = 4 KiB ... 16 MiB, each point weighted by 1/t so that small and
  large messages count alike (the fit minimises relative error);
- one-way messages from rank 0 to rank 1, the others idle -> alpha_1 and beta_1;
- ``acc.add_(other)`` on one rank -> gamma;
- the backend's own all-reduce -> native_alpha, native_beta (same weighted fit).

The fits use messages of 1 MiB and more: the bandwidth regime, where the model is meant to
be within 25 %. Below that, on the 2-vCPU development VM, gloo's waits show erratic
0.1-2 ms stalls (a plain TCP ping-pong between two processes takes 15 us there), so
small-message times are noise around a latency the model only roughly captures.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from shardwise.comm.cost import LinkParams, Profile, host_meta
from shardwise.comm.primitives import Call, configure, group_info

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
FIT_FROM = 1 << 20  # fit on messages of at least 1 MiB (see the module docstring)


def _timed(fn, repeats: int, inner: int) -> float:
    """Median over ``repeats`` of the mean time of ``inner`` calls, started together."""
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t0) / inner)
    return statistics.median(out)


def _inner(nbytes: int) -> int:
    return max(1, min(50, (4 << 20) // max(nbytes, 1)))


def calibration_worker(sizes: list[int], repeats: int) -> dict:
    """Run on every rank; rank 0's timings are the ones used (all ranks start together)."""
    configure(check=False)
    info = group_info(None, "calibrate")
    n, r = info.size, info.rank
    exch, oneway, native = {}, {}, {}
    for m in sizes:
        x = torch.zeros(m // 4)
        y = torch.empty_like(x)
        call = Call("calibrate", "exchange", info, m, account=False)

        def round_trip():
            call.deadline = time.monotonic() + 300
            call.exchange(1, sends=[((r + 1) % n, x)], recvs=[((r - 1) % n, y)])

        def one_way():
            call.deadline = time.monotonic() + 300
            if r == 0:
                call.exchange(1, sends=[(1, x)])
            elif r == 1:
                call.exchange(1, recvs=[(0, y)])

        inner = _inner(m)
        for _ in range(2):  # warm-up, then alternate the three patterns
            round_trip(); one_way(); dist.all_reduce(x)
        t_x, t_1, t_n = [], [], []
        for _ in range(repeats):
            t_x.append(_timed(round_trip, 1, inner))
            t_1.append(_timed(one_way, 1, inner))
            t_n.append(_timed(lambda: dist.all_reduce(x), 1, inner))
        exch[m], oneway[m], native[m] = (statistics.median(t_x), statistics.median(t_1),
                                         statistics.median(t_n))
    a = torch.ones(4 << 20)
    b = torch.ones(4 << 20)
    gamma = _timed(lambda: a.add_(b), repeats, 5) / (a.numel() * 4)
    return {"exchange": exch, "oneway": oneway, "native": native, "gamma": gamma}


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


def params_from(result: dict) -> LinkParams:
    """LinkParams from rank 0's ``calibration_worker`` result (fits on sizes >= FIT_FROM)."""
    def big(points: dict) -> dict:
        return {m: t for m, t in points.items() if int(m) >= FIT_FROM}
    alpha, beta_x = fit_alpha_beta(big(result["exchange"]))
    alpha_1, beta_1 = fit_alpha_beta(big(result["oneway"]))
    n_alpha, n_beta = fit_alpha_beta(big(result["native"]))
    return LinkParams(alpha=alpha, beta_x=beta_x, beta_1=beta_1, gamma=result["gamma"],
                      native_alpha=n_alpha, native_beta=n_beta, alpha_1=alpha_1)


def calibrate(world_sizes: list[int], name: str, repeats: int = 5,
              sizes: list[int] = SIZES, threads: int | None = None) -> tuple[Profile, dict]:
    """Spawn each world size, measure, fit; returns the profile and the raw timings."""
    from shardwise.launch import spawn, threads_per_rank
    params, raw = {}, {}
    for n in world_sizes:
        res = spawn(calibration_worker, n, (sizes, repeats), threads=threads)[0]
        raw[n] = res
        params[n] = params_from(res)
    meta = host_meta() | {"created": time.strftime("%Y-%m-%d %H:%M:%S"),
                          "torch": torch.__version__, "sizes": sizes, "repeats": repeats,
                          "threads_per_rank": {n: threads or threads_per_rank(n)
                                               for n in world_sizes}}
    meta["raw_seconds"] = {str(n): {k: ({str(m): t for m, t in v.items()}
                                        if isinstance(v, dict) else v)
                                    for k, v in res.items()} for n, res in raw.items()}
    return Profile(name, params, meta), raw
