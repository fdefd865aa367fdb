"""Is loopback full-duplex here? What any send/recv all-reduce at N = 2 can reach at best.

    python benchmarks/p2p_duplex.py                          # X = 16, 64 MiB; 21 repeats
    python benchmarks/p2p_duplex.py --sizes 64M --repeats 41 --max-load 0.5

Two gloo ranks (1 torch thread each unless --threads), X bytes of float32, timed per case:

    oneway         rank 0 sends X to rank 1                           X   bytes cross
    exchange X     both send X to the other at once                   2X  bytes cross
    exchange X/2   both send X/2 to the other at once (a ring step)   X   bytes cross
    striped X/2    exchange X/2, each half of it on its own process group (2 sockets and
                   2 gloo I/O threads per rank)                       X   bytes cross
    add X/2        acc.add_(other) over X/2 bytes: the reduction a rank does in a ring
    native         gloo's own dist.all_reduce of X
    ring           shardwise's ring all-reduce of X (pipelined over segment_bytes pieces)
    ring 2-phase   the same with segment_bytes=0: reduce-scatter, then all-gather

Every repeat runs each case once in an order rotated from the previous repeat, started by a
barrier; the slowest rank's time counts; medians over the repeats that no other process
disturbed are reported (``shardwise/comm/quiet.py``: up to 4x --repeats tries), pooled
over --spawns fresh pairs of ranks (3; the VM's speed drifts over minutes). Saved as
``p2p_duplex.txt`` / ``.json`` under --out (``p2p_duplex_threadsT`` with --threads T != 1).

The bound. At N = 2 every rank must receive information about all X bytes of the other's
vector, so any all-reduce made of sends and receives moves at least 2X bytes across the
loopback (a ring: two exchange steps of X/2). If the host moves bytes between the two
ranks at an aggregate rate of at most R (bytes crossing per second, over all directions),
then t >= 2X / R. R is measured with three patterns (one-way, exchange X, exchange X/2,
plus the striped one), and the best of them is taken; the speed-up over gloo's all-reduce
is then at most t_native / (2X / R), whatever the algorithm, before it adds anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

CASES = ("oneway", "exchange X", "exchange X/2", "striped X/2", "add X/2", "native", "ring",
         "ring 2-phase")
# bytes crossing the loopback per case, in units of X (None: not a transfer)
CROSSING = {"oneway": 1.0, "exchange X": 2.0, "exchange X/2": 1.0, "striped X/2": 1.0,
            "native": 2.0, "ring": 2.0, "ring 2-phase": 2.0}


def worker(sizes: list[int], repeats: int) -> dict:
    from shardwise import comm
    from shardwise.comm import quiet
    comm.configure(check=False)
    pids = quiet.rank_pids()
    foreign = quiet.Foreign(pids) if dist.get_rank() == 0 else None
    seg = comm.settings.segment_bytes
    r = dist.get_rank()
    peer = 1 - r
    second = dist.new_group([0, 1])  # its own TCP pairs and I/O thread
    out = {}
    for nbytes in sizes:
        n = nbytes // 4
        h, q = n // 2, n // 4
        x, y = torch.ones(n), torch.empty(n)
        acc, other = torch.ones(h), torch.ones(h)

        def oneway():
            if r == 0:
                dist.isend(x, 1).wait()
            else:
                dist.irecv(y, 0).wait()

        def exchange(m):
            def run():
                a, b = dist.irecv(y[:m], peer), dist.isend(x[:m], peer)
                a.wait()
                b.wait()
            return run

        def striped():
            ws = [dist.irecv(y[:q], peer), dist.irecv(y[q:h], peer, group=second),
                  dist.isend(x[:q], peer), dist.isend(x[q:h], peer, group=second)]
            for w in ws:
                w.wait()

        def ring(segment):
            def run():
                comm.configure(segment_bytes=segment)
                comm.all_reduce(x, algorithm="ring")
            return run

        fns = {"oneway": oneway, "exchange X": exchange(n), "exchange X/2": exchange(h),
               "striped X/2": striped, "add X/2": lambda: acc.add_(other),
               "native": lambda: dist.all_reduce(x), "ring": ring(seg), "ring 2-phase": ring(0)}
        for c in CASES:  # warm-up: connections, buffers, page faults
            fns[c]()
            fns[c]()
        times = {c: [] for c in CASES}

        def one_repeat(rep: int) -> None:
            k = rep % len(CASES)
            for c in CASES[k:] + CASES[:k]:
                dist.barrier()
                t0 = time.perf_counter()
                fns[c]()
                times[c].append(time.perf_counter() - t0)
                x.fill_(1.0)  # keep the all-reduce inputs finite and equal

        loads = quiet.repeat_until_quiet(one_repeat, repeats, 4 * repeats, foreign)
        comm.configure(segment_bytes=seg)
        out[nbytes] = {"times": times, "loads": loads}
    return {"sizes": out, "segment_bytes": seg}


def _wait_for_quiet(max_load: float, wait_s: float) -> float:
    deadline = time.monotonic() + wait_s
    load = os.getloadavg()[0]
    while load > max_load and time.monotonic() < deadline:
        time.sleep(10)
        load = os.getloadavg()[0]
    return load


def analyse(res: list[dict], sizes: list[int]) -> dict:
    from shardwise.comm import quiet
    out = {}
    for nbytes in sizes:
        loads = res[0]["sizes"][nbytes]["loads"]
        med = {c: statistics.median(quiet.quiet_values(
            [max(rk["sizes"][nbytes]["times"][c][i] for rk in res) for i in range(len(loads))],
            loads)) for c in CASES}
        rate = {c: CROSSING[c] * nbytes / med[c] for c in CROSSING}
        best = max(("oneway", "exchange X", "exchange X/2", "striped X/2"), key=rate.get)
        t_min = 2 * nbytes / rate[best]
        out[nbytes] = {
            "median_s": med, "aggregate_Bps": rate, "best_pattern": best,
            "t_min_s": t_min, "t_min_plus_add_s": t_min + med["add X/2"],
            "ring_steps_s": 2 * med["exchange X/2"],
            "max_speedup": med["native"] / t_min,
            "ring_speedup": med["native"] / med["ring"],
            "ring_2phase_speedup": med["native"] / med["ring 2-phase"],
            "needed_Bps_for_1_5x": 2 * nbytes * 1.5 / med["native"],
            "tries": len(loads), "quiet_repeats": sum(x < quiet.THRESHOLD for x in loads),
        }
    return out


def format_result(an: dict, meta: dict) -> str:
    lines = [f"N = 2 gloo ranks on 127.0.0.1, {meta['threads']} torch thread(s) per rank, "
             f"{meta['cores']} cores, median of {meta['repeats']} alternated repeats x "
             f"{meta['spawns']} spawns (slowest rank)", ""]
    head = "case".ljust(14) + "".join(f"{_h(m)} ms".rjust(12) + "GB/s across".rjust(13)
                                      for m in an)
    lines.append(head)
    for c in CASES:
        row = c.ljust(14)
        for m, a in an.items():
            t = a["median_s"][c]
            rate = a["aggregate_Bps"].get(c)
            row += f"{t * 1e3:12.2f}" + (f"{rate / 1e9:13.2f}" if rate else " " * 13)
        lines.append(row)
    lines.append("")
    lines.append("GB/s across = bytes crossing between the ranks (both directions) / time; "
                 "an all-reduce at N=2 moves 2X.")
    for m, a in an.items():
        med = a["median_s"]
        lines += [
            "",
            f"X = {_h(m)} ({a['quiet_repeats']} quiet repeats of {a['tries']} tries):",
            f"  best aggregate rate: {a['aggregate_Bps'][a['best_pattern']] / 1e9:.2f} GB/s "
            f"({a['best_pattern']}); one-way {a['aggregate_Bps']['oneway'] / 1e9:.2f}, "
            f"exchange X {a['aggregate_Bps']['exchange X'] / 1e9:.2f}, "
            f"exchange X/2 {a['aggregate_Bps']['exchange X/2'] / 1e9:.2f}, "
            f"striped {a['aggregate_Bps']['striped X/2'] / 1e9:.2f}",
            f"  lower bound of any send/recv all-reduce: 2X / best rate = "
            f"{a['t_min_s'] * 1e3:.2f} ms (+ add X/2 if not hidden: "
            f"{a['t_min_plus_add_s'] * 1e3:.2f} ms); ring's own steps 2 x exchange X/2 = "
            f"{a['ring_steps_s'] * 1e3:.2f} ms",
            f"  gloo all_reduce {med['native'] * 1e3:.2f} ms -> best possible speed-up "
            f"{a['max_speedup']:.2f}x; 1.5x would need {med['native'] / 1.5 * 1e3:.2f} ms, "
            f"i.e. {a['needed_Bps_for_1_5x'] / 1e9:.2f} GB/s across "
            f"({a['needed_Bps_for_1_5x'] / a['aggregate_Bps'][a['best_pattern']]:.2f}x the best "
            "rate measured)",
            f"  one-way X is {med['native'] / med['oneway']:.2f}x faster than gloo's all-reduce of "
            f"X, but an all-reduce moves 2X: 2 x one-way = {2 * med['oneway'] * 1e3:.2f} ms, "
            f"{med['native'] / (2 * med['oneway']):.2f}x gloo",
            f"  measured: ring {a['ring_speedup']:.2f}x gloo (pipelined, segment "
            f"{_h(meta['segment_bytes'])}), ring 2-phase {a['ring_2phase_speedup']:.2f}x",
        ]
    lines += ["", "meta: " + json.dumps(meta)]
    return "\n".join(lines)


def _h(m: int) -> str:
    return f"{m >> 20}M" if m >= 1 << 20 and m % (1 << 20) == 0 else f"{m >> 10}K"


def main(argv: list[str] | None = None) -> int:
    from shardwise.cli.bench import parse_size
    from shardwise.comm.cost import host_meta
    from shardwise.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16M,64M", help="message sizes X (default 16M,64M)")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--spawns", type=int, default=3, help="fresh pairs of ranks, repeats pooled "
                    "(default 3; the host's speed drifts over minutes)")
    ap.add_argument("--max-load", type=float, default=None, help="wait (up to --wait-s) until "
                    "the 1-minute load average is below this before measuring")
    ap.add_argument("--wait-s", type=float, default=900)
    ap.add_argument("--out", default="benchmarks/comm_results")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    load = (_wait_for_quiet(args.max_load, args.wait_s) if args.max_load is not None
            else os.getloadavg()[0])
    t0 = time.time()
    runs = [spawn(worker, 2, (sizes, args.repeats), threads=args.threads)
            for _ in range(args.spawns)]
    res = [{"segment_bytes": runs[0][r]["segment_bytes"],  # the spawns' repeats, pooled
            "sizes": {m: {"loads": [x for run in runs for x in run[0]["sizes"][m]["loads"]],
                          "times": {c: [t for run in runs for t in run[r]["sizes"][m]["times"][c]]
                                    for c in CASES}}
                      for m in sizes}} for r in range(2)]
    an = analyse(res, sizes)
    meta = host_meta() | {"threads": args.threads, "repeats": args.repeats,
                          "spawns": args.spawns,
                          "loadavg_1min_before": round(load, 2),
                          "loadavg_1min_after": round(os.getloadavg()[0], 2),
                          "segment_bytes": res[0]["segment_bytes"], "torch": torch.__version__,
                          "seconds": round(time.time() - t0, 1),
                          "command": "python benchmarks/p2p_duplex.py " + " ".join(
                              argv if argv is not None else sys.argv[1:])}
    text = format_result(an, meta)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "p2p_duplex" if args.threads == 1 else f"p2p_duplex_threads{args.threads}"
    (out / f"{stem}.txt").write_text(text + "\n")
    (out / f"{stem}.json").write_text(json.dumps(
        {"meta": meta, "results": {str(m): a for m, a in an.items()},
         "raw": {str(m): res[0]["sizes"][m] for m in sizes}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
