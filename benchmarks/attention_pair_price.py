"""What a (query, key) pair costs each way the engine runs attention: the planner's
``planner.attention.FUSED_PAIR`` measured.

The planner counts a causal attention PaLM's way (the s x s triangle whole) and prices the
count as GEMMs. Three calls on the same (B, H, T, D) q, k, v, forward + backward:

- ``is_causal``: SDPA told the mask is causal (a fused kernel that skips the blocks above
  the diagonal: it scores about T^2 / 2 pairs);
- ``masked``: SDPA given the same causal triangle as a boolean mask (the engine's call for
  document masks and window bands: every pair of the call scored);
- ``math``: the scores written out, ``q @ k^T``, masked softmax, ``@ v`` (the engine's
  math path and soft-capped scores: two GEMMs over every pair).

The planner's prices say: ``masked`` / ``is_causal`` = ``FUSED_PAIR`` (2: twice the pairs
at one kernel's rate), and ``math`` / ``is_causal`` = 1 (the count at GEMM rate). Both
ratios are printed per T, medians of ``--repeats`` runs after one warm-up, alternating the
three calls.

    OMP_NUM_THREADS=2 python benchmarks/attention_pair_price.py   # about 1 minute
    python benchmarks/attention_pair_price.py --device cuda --lengths 2048,4096,8192 \
        --heads 16 --dtype bf16

Writes ``OUT/attention_pair_price.{json,md}`` (OUT: ``benchmarks/attention_pair_price_results``
or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

OUT = Path(__file__).resolve().parent / "attention_pair_price_results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _math(q, k, v, mask):
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    scores = scores.float().masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(q.dtype) @ v


def calls(mask: torch.Tensor) -> dict:
    """The three ways, each ``(q, k, v) -> out``."""
    return {"is_causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                        is_causal=True),
            "masked": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
            "math": lambda q, k, v: _math(q, k, v, mask)}


def measure(T: int, args) -> dict:
    """Median forward + backward milliseconds of each call at T tokens."""
    dev, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, T, args.head_dim, device=dev, dtype=dtype,
                           requires_grad=True) for _ in range(3))
    mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    fns, times = calls(mask), {}

    def once(fn) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(q, k, v).sum().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    for fn in fns.values():  # warm-up
        once(fn)
    for _ in range(args.repeats):
        for name, fn in fns.items():
            times.setdefault(name, []).append(once(fn))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {"T": T, **{f"{n}_ms": round(m, 2) for n, m in med.items()},
            "masked_over_is_causal": round(med["masked"] / med["is_causal"], 3),
            "math_over_is_causal": round(med["math"] / med["is_causal"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from shardwise.perf.peak import cpu_name

    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "device": args.device, "dtype": args.dtype, "heads": args.heads,
            "head_dim": args.head_dim, "repeats": args.repeats,
            "load_average": round(os.getloadavg()[0], 2)}
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    rows = [measure(int(T), args) for T in args.lengths.split(",")]
    info["load_average_after"] = round(os.getloadavg()[0], 2)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_pair_price.json").write_text(json.dumps(
        {"machine": info, "rows": rows}, indent=1) + "\n")
    head = ("| T | is_causal ms | masked ms | math ms | masked / is_causal | "
            "math / is_causal |\n|---|---|---|---|---|---|\n")
    body = "".join(f"| {r['T']} | {r['is_causal_ms']} | {r['masked_ms']} | {r['math_ms']} | "
                   f"{r['masked_over_is_causal']} | {r['math_over_is_causal']} |\n"
                   for r in rows)
    text = (f"Machine: {json.dumps(info)}\n\nForward + backward of one attention call, "
            f"B 1, medians of {args.repeats}.\n\n{head}{body}")
    (args.out / "attention_pair_price.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
