"""The seeds' comparison of all-reduce implementations, from measured byte counters.

MIT 6.S965 (seed 003), "All Reduce Implementations Comparison": time, peak node bandwidth
and total bandwidth of the parameter server, sequential, ring, parallel and recursive
halving all-reduce, as orders of growth in N. Here each row is measured: N ranks run one
all-reduce of X bytes with accounting on, and

    steps  = the largest round number any rank took part in (the schedule's time steps)
    peak   = max over ranks of max(bytes sent, bytes received), in units of X
    total  = bytes sent by all ranks together, in units of X

beside the exact formula of our implementation and the seed's order of growth. Our
"sequential" is the pass-along chain of the issue (peak 2X); the seed's sequential row
(peak O(N)) describes each rank sending its vector to all others in turn.
"""

from __future__ import annotations

import math

import torch

ROWS = (  # algorithm, seed row name, seed (time, peak, total)
    ("naive", "Parameter Server", ("O(1)", "O(N)", "O(N)")),
    ("sequential", "All-Reduce - Sequential", ("O(N)", "O(N)", "O(N)")),
    ("ring", "All-Reduce - Ring", ("O(N)", "O(1)", "O(N)")),
    ("parallel", "All-Reduce - Parallel", ("O(1)", "O(N)", "O(N^2)")),
    ("halving_doubling", "All-Reduce - Recursive Halving", ("O(lgN)", "O(1)", "O(N)")),
    ("tree", "(binomial tree, not in the seed)", ("-", "-", "-")),
)
X_NUMEL = 1 << 18  # 1 MiB of float32, divisible by every N up to 2^18


def formulas(algorithm: str, n: int) -> tuple[str, float, str, float, str, float]:
    """(steps formula, value, peak formula, value in X, total formula, value in X)."""
    L = math.ceil(math.log2(n))
    p = 1 << (n.bit_length() - 1)
    if algorithm == "naive":
        return "2", 2, "N-1", n - 1, "2(N-1)", 2 * (n - 1)
    if algorithm == "sequential":
        return "2(N-1)", 2 * (n - 1), "min(2,N-1)", min(2, n - 1), "2(N-1)", 2 * (n - 1)
    if algorithm == "ring":
        return "2(N-1)", 2 * (n - 1), "2(N-1)/N", 2 * (n - 1) / n, "2(N-1)", 2 * (n - 1)
    if algorithm == "parallel":
        return "1", 1, "N-1", n - 1, "N(N-1)", n * (n - 1)
    if algorithm == "halving_doubling":
        if p == n:
            return "2log2N", 2 * L, "2(N-1)/N", 2 * (n - 1) / n, "2(N-1)", 2 * (n - 1)
        return ("2log2p+2", 2 * int(math.log2(p)) + 2, "1+2(p-1)/p", 1 + 2 * (p - 1) / p,
                "2(p-1)+2(N-p)", 2 * (p - 1) + 2 * (n - p))
    if algorithm == "tree":
        return "2ceil(log2N)", 2 * L, "ceil(log2N)", L, "2(N-1)", 2 * (n - 1)
    raise ValueError(algorithm)


def table_worker() -> list[dict]:
    """On one rank: run each of ROWS's all-reduce algorithms once on X_NUMEL float32 and return the
    accounting table of the calls it recorded."""
    from shardwise import comm
    from shardwise.comm import accounting
    comm.configure(check=False)
    x = torch.ones(X_NUMEL)
    with accounting.recording() as rec:
        for algo, _, _ in ROWS:
            comm.all_reduce(x.clone(), algorithm=algo)
    return accounting.table(rec.records)


def measure(world_sizes: list[int]) -> list[dict]:
    """Spawn each world size in ``world_sizes`` and return one row per (N, algorithm): the measured
    steps, peak and total bytes (in X, the vector's bytes) beside their formulas and the seed
    paper's row."""
    from shardwise.launch import spawn
    rows = []
    for n in world_sizes:
        per_rank = spawn(table_worker, n)
        for algo, seed_name, seed in ROWS:
            recs = [r for rank in per_rank for r in rank if r["algorithm"] == algo]
            x = recs[0]["nbytes"]
            f = formulas(algo, n)
            rows.append({
                "N": n, "algorithm": algo, "seed_row": seed_name, "X_bytes": x,
                "steps": max(r["last_step"] for r in recs), "steps_formula": f[0],
                "steps_expected": f[1],
                "peak_X": max(max(r["bytes_sent"], r["bytes_recv"]) for r in recs) / x,
                "peak_formula": f[2], "peak_expected": f[3],
                "total_X": sum(r["bytes_sent"] for r in recs) / x, "total_formula": f[4],
                "total_expected": f[5], "seed_time": seed[0], "seed_peak": seed[1],
                "seed_total": seed[2]})
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows of ``measure`` as a plain-text table; a row whose counts differ from its formulas is
    marked ``(!)``."""
    head = ("N", "algorithm", "steps", "= formula", "peak/X", "= formula", "total/X",
            "= formula", "seed: time", "peak", "total")
    body = []
    for r in rows:
        ok = (r["steps"] == r["steps_expected"]
              and math.isclose(r["peak_X"], r["peak_expected"], rel_tol=1e-9)
              and math.isclose(r["total_X"], r["total_expected"], rel_tol=1e-9))
        body.append((str(r["N"]), r["algorithm"] + ("" if ok else " (!)"), str(r["steps"]),
                     r["steps_formula"], f"{r['peak_X']:.3g}", r["peak_formula"],
                     f"{r['total_X']:.3g}", r["total_formula"], r["seed_time"], r["seed_peak"],
                     r["seed_total"]))
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    prev = None
    for b in body:
        if prev is not None and b[0] != prev:
            lines.append("")
        prev = b[0]
        lines.append("  ".join(v.ljust(w) for v, w in zip(b, widths)))
    lines.append("\nmeasured from per-rank byte counters, X = 1 MiB float32; peak = max over "
                 "ranks of max(sent, received); total = bytes sent by all ranks; (!) marks a "
                 "measurement that differs from its formula")
    return "\n".join(lines)
