"""Measure the cost model's constants on this machine (``shardwise bench comm --calibrate``).

For each world size N, N ranks are spawned and time five transfer patterns (relay ->
alpha_1, beta_link; exchange -> alpha, beta_host; swap -> alpha_swap), a local reduction
(add alone -> gamma; add all -> gamma_host), the backend's all-reduce (native_alpha,
native_beta) and, where ``shm.available()``, the shared-memory all-reduce (shm_alpha,
shm_beta), alternating them within each repeat and taking the slowest rank's median over
the repeats no other process disturbed (``quiet.py``), pooled over 3 spawns. Latencies
are medians of 16-256 KiB steps, slopes least squares through the origin over 1-64 MiB.
Each pattern and fit, and why: docs/comm.md, "How calibration measures".
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from shardwise.comm import quiet, shm
from shardwise.comm.check import group_device
from shardwise.comm.cost import LinkParams, Profile, device_kind, host_meta
from shardwise.comm.primitives import Call, configure, group_info

LATENCY_SIZES = [16 << 10, 64 << 10, 256 << 10]  # steps whose median time is alpha / alpha_1
SIZES = LATENCY_SIZES + [m << 20 for m in (1, 2, 4, 8, 16, 32, 64)]
FIT_FROM = 1 << 20  # per-byte fits on messages of at least 1 MiB (see the module docstring)
PATTERNS = ("relay", "exchange", "swap", "add_alone", "add_all", "native", "shm")


def _inner(nbytes: int) -> int:
    return max(1, min(20, (2 << 20) // max(nbytes, 1)))  # as the sweep (bench.py)


def calibration_worker(sizes: list[int], repeats: int) -> dict:
    """Run on every rank; per pattern and size, the slowest rank's time of every repeat,
    and the foreign load each repeat saw (``quiet.py``)."""
    configure(check=False)
    info = group_info(None, "calibrate")
    n, r = info.size, info.rank
    dev = group_device(None)  # CUDA with NCCL: a profile of that backend on that GPU model
    pids = quiet.rank_pids()  # collective: every rank
    foreign = quiet.Foreign(pids) if r == 0 else None
    out: dict = {p: {} for p in PATTERNS}
    out["foreign"] = {}
    out["backend"], out["device"] = str(dist.get_backend()), device_kind(dev)
    seg = shm.segment(info) if shm.available() and dev.type == "cpu" else None
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for m in sizes:
        x, y = torch.ones(m // 4, device=dev), torch.empty(m // 4, device=dev)
        call = Call("calibrate", "pattern", info, m, account=False)
        inner = _inner(m)

        def relay() -> None:  # inner trips round the ring, one hop at a time
            for _ in range(inner):
                if r > 0:
                    call.exchange(r, recvs=[(r - 1, y)])
                    x.add_(y)
                call.exchange(r + 1, sends=[((r + 1) % n, x)])
                if r == 0:
                    call.exchange(n, recvs=[(n - 1, y)])
                    x.add_(y)

        def exchange() -> None:  # inner ring steps back to back, as ring.all_reduce runs them
            sends = []
            for _ in range(inner):
                got = call.irecv(1, (r - 1) % n, y)
                sends.append(call.isend(1, (r + 1) % n, x))
                call.wait(got)
            for posted in sends:
                call.wait(posted)

        masks = [1 << j for j in range((n.bit_length() - 1) or 1)]

        def swap() -> None:  # inner pairwise swaps r <-> r xor 2^j, as halving-doubling's
            sends = []
            for i in range(inner):
                peer = r ^ masks[i % len(masks)]
                if peer < n:
                    got = call.irecv(1, peer, y)
                    sends.append(call.isend(1, peer, x))
                    call.wait(got)
            for posted in sends:
                call.wait(posted)

        def add_after(receivers: set[int]) -> float:
            """Rank 0 sends m bytes to rank 1 (receivers {1}) or every rank to its right
            (all); then each receiver adds what it got into x: the add alone is timed."""
            if len(receivers) == 1:
                if r == 0:
                    call.exchange(1, sends=[(1, x)])
                elif r == 1:
                    call.exchange(1, recvs=[(0, y)])
            else:
                call.exchange(1, sends=[((r + 1) % n, x)], recvs=[((r - 1) % n, y)])
            if r not in receivers:
                return 0.0
            sync()
            t0 = time.perf_counter()
            x.add_(y)
            sync()
            return time.perf_counter() - t0

        fns = {"relay": relay, "exchange": exchange, "swap": swap,
               "add_alone": lambda: add_after({1}),
               "add_all": lambda: add_after(set(range(n))),
               "native": lambda: [dist.all_reduce(x) for _ in range(inner)],
               "shm": lambda: [shm.all_reduce(seg, call, x, "sum") for _ in range(inner)
                               if seg is not None]}
        times: dict = {p: [] for p in PATTERNS}

        def one_repeat(i: int) -> None:
            k = i % len(PATTERNS)
            for p in PATTERNS[k:] + PATTERNS[:k]:
                call.deadline = time.monotonic() + 300
                dist.barrier()
                t0 = time.perf_counter()
                own = fns[p]()
                sync()
                t = own if isinstance(own, float) else (time.perf_counter() - t0) / inner
                times[p].append(t)
                x.fill_(1.0)

        for p in PATTERNS:  # warm-up
            fns[p]()
        loads = quiet.repeat_until_quiet(one_repeat, repeats, 4 * repeats, foreign)
        # per repeat, the slowest rank (each rank times itself; all started by the barrier)
        t = torch.tensor([times[p] for p in PATTERNS], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        for p, row in zip(PATTERNS, t.tolist()):
            out[p][m] = [v / n for v in row] if p == "relay" else row  # relay: per hop
        out["foreign"][m] = loads
    return out


def pool(results: list[dict]) -> dict:
    """Rank 0's results of several spawns -> per pattern and size, the median of every
    quiet repeat of every spawn, and the repeat counts."""
    out: dict = {p: {} for p in PATTERNS}
    out["repeats"] = {}
    for m in results[0]["foreign"]:
        loads = [x for res in results for x in res["foreign"][m]]
        for p in PATTERNS:
            every = [v for res in results for v in res[p][m]]
            out[p][m] = statistics.median(quiet.quiet_values(every, loads))
        out["repeats"][m] = {"tries": len(loads),
                             "quiet": sum(x < quiet.THRESHOLD for x in loads)}
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


def fit_slope(points: dict[int, float], intercept: float) -> float:
    """Least squares of t - intercept = m slope through the origin (absolute errors)."""
    num = sum(m * (t - intercept) for m, t in points.items())
    return max(num / sum(m * m for m in points), 1e-13)


def params_from(result: dict, n: int) -> LinkParams:
    """LinkParams from ``calibration_worker``'s result at world size ``n``."""
    def big(points: dict) -> dict:
        return {int(m): t for m, t in points.items() if int(m) >= FIT_FROM}

    def latency(points: dict) -> float:
        return statistics.median(t for m, t in points.items() if int(m) in LATENCY_SIZES)
    hop = {m: t - result["add_alone"][m] for m, t in result["relay"].items()}  # minus the add
    alpha_1, alpha = latency(hop), latency(result["exchange"])
    alpha_swap = latency(result["swap"])
    n_alpha, n_beta = fit_alpha_beta(big(result["native"]))
    s_alpha = s_beta = -1.0
    if result.get("shm") and min(result["shm"].values()) > 0:
        rounds = {int(m): shm.rounds(int(m) // 4, 4, n) for m in result["shm"]}
        s_alpha = statistics.median(t / rounds[int(m)] for m, t in result["shm"].items()
                                    if int(m) in LATENCY_SIZES)
        s_beta = fit_slope({m: t - rounds[m] * s_alpha for m, t in big(result["shm"]).items()},
                           0.0)
    return LinkParams(shm_alpha=s_alpha, shm_beta=s_beta, alpha=alpha, alpha_1=alpha_1,
                      alpha_swap=alpha_swap,
                      beta_link=fit_slope(big(hop), alpha_1),
                      beta_host=fit_slope(big(result["exchange"]), alpha) / n,
                      gamma=fit_slope(big(result["add_alone"]), 0.0),
                      gamma_host=fit_slope(big(result["add_all"]), 0.0) / n,
                      native_alpha=n_alpha, native_beta=n_beta)


def calibrate(world_sizes: list[int], name: str, repeats: int = 5,
              sizes: list[int] = SIZES, threads: int | None = None,
              spawns: int = 3, device: str = "cpu") -> tuple[Profile, dict]:
    """Spawn each world size ``spawns`` times, measure, pool, fit; returns the profile and
    the pooled medians.

    ``device``: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank); the profile records the
    backend and the device kind, and ``auto`` uses it only for tensors of that kind.

    Several spawns because where the scheduler puts the ranks (two neighbours on one core
    or on two) is decided per spawn and changes a hop's time by up to 2x at N = 4 here.
    """
    from shardwise.launch import spawn, threads_per_rank
    params, raw = {}, {}
    where = ("gloo", "cpu")
    for n in world_sizes:
        runs = [spawn(calibration_worker, n, (sizes, repeats), threads=threads,
                      device=device)[0] for _ in range(spawns)]
        where = (runs[0].pop("backend"), runs[0].pop("device"))
        res = pool(runs)
        raw[n] = res
        params[n] = params_from(res, n)
    meta = host_meta() | {"backend": where[0], "device": where[1],
                          "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                          "torch": torch.__version__, "sizes": sizes, "repeats": repeats,
                          "spawns": spawns,
                          "threads_per_rank": {n: threads or threads_per_rank(n)
                                               for n in world_sizes}}
    meta["median_seconds"] = {str(n): {k: {str(m): t for m, t in v.items()}
                                       for k, v in res.items()} for n, res in raw.items()}
    return Profile(name, params, meta), raw
