"""Sliding-window attention at cp = 1: one call with the (T, T) band against query chunks.

``models.gpt.causal_attention`` with a window of W < T tokens splits the queries into chunks
of c tokens, each one call against its keys [s - W + 1, s + c) with a (c, c + W - 1) band
(``models.gpt._windowed``; c = T is the one dense call, the path before chunking). For every
(T, W, attention, c): forward + backward of one attention call on random (B, H, T, D) fp32
q, k, v (B = 1, H = 8, D = 64 by default), in a fresh process per point:

- ``time_ms``: the median of ``--repeats`` forward + backward runs after one warm-up (the
  machine is shared; the median over repeats, and the load average is recorded);
- ``peak_mib``: on the CPU, the process's peak resident memory during the warm-up run above
  its resident memory before it (``VmHWM``, reset through ``/proc/self/clear_refs``; the
  gradients of q, k, v, the same for every c, included); on CUDA,
  ``torch.cuda.max_memory_allocated`` above the allocation before it;
- ``scores``: query-key pairs scored (T^2 dense; sum of c_i (c_i + W - 1) chunked, the
  first chunks' fewer), ``mask_mib``: the largest boolean mask of one call (T^2 or
  c (c + W - 1) bytes), ``written_mib``: the largest fp32 score tensor of one call written
  out (``math``: B H c (c + W - 1) x 4 bytes).

    OMP_NUM_THREADS=2 python benchmarks/windowed_attention.py  # 25 min on 2 shared cores
    python benchmarks/windowed_attention.py --lengths 512,1024 --windows 256,512 \
        --chunks 256,512 --repeats 7 --out benchmarks/windowed_attention_results/threshold
    python benchmarks/windowed_attention.py --device cuda --lengths 8192,16384 --windows 4096 \
        --chunks 4096,8192
    python benchmarks/windowed_attention.py --lengths 2048 --windows 256 --chunks 256 --repeats 2

Writes ``OUT/windowed_attention.json`` and ``OUT/windowed_attention.md`` (OUT:
``benchmarks/windowed_attention_results``, or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "windowed_attention_results"


def machine(device: str) -> dict:
    """The CPU (or GPU), its cores, the threads, the versions and the load."""
    from shardwise.perf.peak import cpu_name

    cpu = cpu_name()
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "device": device, "load_average": round(os.getloadavg()[0], 2)}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def counts(T: int, W: int, c: int, B: int, H: int) -> dict:
    """Scores, the largest mask and the largest written-out fp32 scores of one call."""
    scores, biggest = 0, (0, 0)
    for s in range(0, T, c):
        e, a = min(s + c, T), max(0, s - W + 1)
        scores += (e - s) * (e - a)
        biggest = max(biggest, (e - s, e - a), key=lambda x: x[0] * x[1])
    mib = 2 ** 20
    return {"scores": scores, "mask_mib": biggest[0] * biggest[1] / mib,
            "written_mib": B * H * biggest[0] * biggest[1] * 4 / mib}


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def measure(T: int, W: int, impl: str, cs: list[int], B: int, H: int, D: int, repeats: int,
            device: str) -> list[dict]:
    """The points (T, W, impl, c) for every c of ``cs``, in this process: the peak memory
    of one run each (``repeats`` = 0), or, after that run as a warm-up, ``repeats`` rounds
    timing every c in turn (interleaved, so that a burst of other work on the machine is
    spread over all of them)."""
    from shardwise.models.gpt import _windowed

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g, device=device, requires_grad=True)
               for _ in range(3))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step(c):
        out = _windowed(q, k, v, W, c, None, 0.0, impl, None, None)
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None
        sync()

    peaks = []
    for c in cs:  # also the warm-up
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step(c)
            peaks.append((torch.cuda.max_memory_allocated() - before) / 2 ** 20)
        else:
            try:  # "5": reset the peak resident size (Linux >= 4.0)
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass
            before = _rss_kib("VmRSS:")
            step(c)
            peaks.append((_rss_kib("VmHWM:") - before) / 1024)
    times = {c: [] for c in cs}
    for _ in range(repeats):
        for c in cs:
            t0 = time.perf_counter()
            step(c)
            times[c].append(time.perf_counter() - t0)
    if not repeats:
        return [{"c": c, "peak_mib": peak} for c, peak in zip(cs, peaks)]
    return [{"c": c, "time_ms": 1e3 * statistics.median(times[c]),
             "min_ms": 1e3 * min(times[c]), "times_ms": [1e3 * t for t in times[c]]}
            for c in cs]


def groups(args) -> list[tuple[int, int, str, list[int]]]:
    """(T, W, impl, [c]) to measure: c = T (dense) and every ``--chunks`` c < T."""
    return [(T, W, impl, [T] + [c for c in args.chunks if c < T])
            for T in args.lengths for W in args.windows if W < T for impl in args.impls]


def table(rows: list[dict], info: dict, command: str) -> str:
    lines = [f"# Sliding-window attention: one call against query chunks ({info['device']})", "",
             f"`{command}`", "",
             (f"{info.get('gpu', info['cpu'])}, {info['cores']} cores, {info['torch_threads']} "
             f"torch threads, torch {info['torch']}, python {info['python']}; load average "
             f"{info['load_average']} before, {info['load_average_after']} after. "
             f"B = {rows[0]['B']}, H = {rows[0]['H']}, D = {rows[0]['D']}, fp32, forward + "
             "backward of one attention call; time: the median of the repeats (their "
             "fastest beside it); x dense: of the medians."), "",
             ("| T | W | attention | c | time ms | fastest ms | x dense | peak MiB | "
              "scores / T^2 | mask MiB | written MiB |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    dense = {(r["T"], r["W"], r["impl"]): r for r in rows if r["c"] == r["T"]}
    for r in rows:
        d = dense[(r["T"], r["W"], r["impl"])]
        c = "dense" if r["c"] == r["T"] else r["c"]
        lines.append(f"| {r['T']} | {r['W']} | {r['impl']} | {c} | {r['time_ms']:.1f} | "
                     f"{r['min_ms']:.1f} | "
                     f"{r['time_ms'] / d['time_ms']:.2f} | {r['peak_mib']:.0f} | "
                     f"{r['scores'] / r['T'] ** 2:.3f} | {r['mask_mib']:.2f} | "
                     f"{r['written_mib'] if r['impl'] == 'math' else 0:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]
    p.add_argument("--lengths", type=ints, default=[2048, 4096, 8192])
    p.add_argument("--windows", type=ints, default=[256, 512])
    p.add_argument("--chunks", type=ints, default=[256, 512, 1024],
                   help="query chunk sizes c besides the dense call (c = T)")
    p.add_argument("--impls", type=lambda s: s.split(","), default=["sdpa", "math"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--render", action="store_true",
                   help="only write OUT/windowed_attention.md again from its .json")
    p.add_argument("--one", help=argparse.SUPPRESS)  # "T,W,impl,c,...": in this process
    args = p.parse_args()
    shape = (args.batch, args.heads, args.head_dim)
    if args.one:
        T, W, impl, *cs = args.one.split(",")
        print(json.dumps(measure(int(T), int(W), impl, [int(c) for c in cs], *shape,
                                 args.repeats, args.device)))
        return
    if args.render:
        got = json.loads((args.out / "windowed_attention.json").read_text())
        (args.out / "windowed_attention.md").write_text(
            table(got["rows"], got["machine"], got["command"]))
        return
    info = machine(args.device)
    command = "python " + " ".join(["benchmarks/windowed_attention.py"] + sys.argv[1:])
    # memory in a process of its own where, on the CPU, every allocation of 64 KiB or more
    # is its own mapping, given back when freed: the resident size then follows the tensors
    # alive, and its peak is theirs (the page faults of so many mappings would slow the
    # many small calls of the chunks, so the times come from a process with glibc's default)
    memory_env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = []
    for T, W, impl, cs in groups(args):
        cmd = [sys.executable, __file__, "--one", ",".join(map(str, [T, W, impl, *cs])),
               "--device", args.device, "--batch", str(args.batch), "--heads",
               str(args.heads), "--head-dim", str(args.head_dim), "--repeats"]
        got = [json.loads(subprocess.run(cmd + [str(r)], check=True, capture_output=True,
                                         text=True, env=env).stdout.splitlines()[-1])
               for r, env in ((0, memory_env), (args.repeats, None))]
        for r in (m | t for m, t in zip(*got)):
            row = {"T": T, "W": W, "impl": impl, "B": args.batch, "H": args.heads,
                   "D": args.head_dim, **r, **counts(T, W, r["c"], args.batch, args.heads)}
            print(f"T={T} W={W} {impl} c={'dense' if r['c'] == T else r['c']}: "
                  f"{row['time_ms']:.1f} ms, peak {row['peak_mib']:.0f} MiB", flush=True)
            rows.append(row)
    info["load_average_after"] = round(os.getloadavg()[0], 2)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "windowed_attention.json").write_text(json.dumps(
        {"machine": info, "command": command, "rows": rows,
         "args": {k: v for k, v in vars(args).items() if k in (
             "lengths", "windows", "chunks", "impls", "batch", "heads", "head_dim",
             "repeats", "device")}}, indent=1) + "\n")
    (args.out / "windowed_attention.md").write_text(table(rows, info, command))
    print(table(rows, info, command))


if __name__ == "__main__":
    main()
