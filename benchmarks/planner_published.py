"""The planner against published large-scale results: throughput and memory per GPU.

1. Weak scaling of Megatron-LM on DGX A100 (80 GB) nodes, Narayanan et al., SC 2021,
   "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
   arXiv:2104.04473, Table 1 (also the Megatron-LM README): GPT models of 1.7B to 1T
   parameters on 32 to 3072 GPUs, fp16 with activation recomputation, sequence 2048,
   vocabulary 51200. Published: achieved teraFLOP/s per GPU, counting the paper's FLOPs
   F = 96 B s l h^2 (1 + s / 6h + V / 16 l h) (their eq. 3, recomputation included).
   Predicted: the same F divided by the simulator's step time and the GPU count, for the
   published tp x pp x dp with full recomputation, ZeRO-0, no sequence parallelism, the
   planner choosing only what the paper does not list: micro-batch size (1, 2, 4, 8),
   schedule (1F1B, interleaved v = 2, 4) and stage cut (by layer count, or by parameters:
   Megatron's even blocks per stage). Two compute models: ``fixed`` (the preset: every
   matmul at 0.5 of the datasheet peak) and ``per-op`` (``hardware.per_op``: each GEMM at
   the efficiency Calculon's A100 table gives its size, each memory-bound kernel of
   Megatron-LM 2021 -- softmax and dropout on the s x s scores, fused bias + GELU, fused
   bias + dropout + add, LayerNorm -- by the bytes it moves, links at Calculon's
   efficiencies; Isaev et al. SC 2023). No constant is fitted to this table.
   Then the planner's own choice over the whole space (tp inside a node, ZeRO 0-1,
   recompute and sequence parallelism on or off, micro-batches 1, 2, 4; the default fixed
   model), and whether it is the published layout.
2. ZeRO memory, Rajbhandari et al., SC 2020, "ZeRO: Memory Optimizations Toward Training
   Trillion Parameter Models", arXiv:1910.02054, Table 1: GB per device for 7.5B, 128B and
   1T parameters with P_os, P_os+g, P_os+g+p (ZeRO-1, 2, 3) at dp 1 ... 1024
   (mixed-precision Adam, K = 12), against ``planner.memory.zero_bytes``.

The constants are the cluster preset's (``planner.hardware``: datasheet peak, NVLink and
InfiniBand bandwidths) and, for ``per-op``, Calculon's documented efficiency tables. Writes
``OUT/planner_published.txt`` and ``.json``.

    python benchmarks/planner_published.py --out benchmarks/planner_results
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# model, tp, pp, GPUs, global batch, published teraFLOP/s per GPU (Narayanan et al. Table 1)
MEGATRON = [("megatron-1.7b", 1, 1, 32, 512, 137), ("megatron-3.6b", 2, 1, 64, 512, 138),
            ("megatron-7.5b", 4, 1, 128, 512, 142), ("megatron-18b", 8, 1, 256, 1024, 135),
            ("megatron-39b", 8, 2, 512, 1536, 138), ("megatron-76b", 8, 4, 1024, 1792, 140),
            ("megatron-146b", 8, 8, 1536, 2304, 148), ("megatron-310b", 8, 16, 1920, 2160, 155),
            ("megatron-530b", 8, 35, 2520, 2520, 163), ("megatron-1t", 8, 64, 3072, 3072, 163)]

# Rajbhandari et al. Table 1: GB per device, (P_os, P_os+g, P_os+g+p) per dp degree
ZERO = {7.5e9: {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5),
                64: (31.4, 16.6, 1.88), 256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
        128e9: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128),
                64: (536, 284, 32), 256: (518, 263, 8), 1024: (513, 257, 2)},
        1e12: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000),
               64: (4187, 2218, 250), 256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)}}


def paper_flops(spec, batch: int) -> float:
    s, h, L, V = spec.block_size, spec.n_embd, spec.n_layer, spec.vocab_size
    return 96 * batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def published_layout(spec, cluster, tp, pp, gpus, batch):
    """The paper's tp x pp x dp with full recomputation, ZeRO-0, no sequence parallelism, fp16,
    the best (predicted) of what it does not list: micro-batch size 1, 2, 4, 8, schedule
    (1F1B, interleaved v = 2, 4) and stage cut (layer count, parameters)."""
    from shardwise.planner.search import memory_of, prune_reason
    from shardwise.planner.simulate import Layout, simulate

    dp = gpus // (tp * pp)
    per = batch // dp
    best = None
    scheds = [("1f1b", 1)] + ([("interleaved", 2), ("interleaved", 4)] if pp > 1 else [])
    for mb in (1, 2, 4, 8):
        if per % mb:
            continue
        for (kind, v), by in itertools.product(scheds, ("layers", "params") if pp > 1
                                               else ("layers",)):
            lay = Layout(dp, tp, pp, mb, per // mb, kind, v, 0, True, False, by)
            if prune_reason(spec, lay, cluster, False):
                continue
            mem = memory_of(spec, lay, "fp16")
            if mem["total"] > cluster.memory:
                continue
            t = simulate(spec, lay, cluster, "fp16")
            if best is None or t["step"] < best[1]["step"]:
                best = (lay, t, mem)
    return best


def megatron_rows() -> list[dict]:
    from shardwise.planner.hardware import PRESETS, per_op
    from shardwise.planner.search import plan
    from shardwise.planner.specs import NAMED

    a100 = PRESETS["dgx-a100-80gb"]
    models = {"fixed": a100, "per-op": per_op(a100, "megatron-2021")}
    rows = []
    for name, tp, pp, gpus, batch, published in MEGATRON:
        t0 = time.process_time()
        spec = NAMED[name]
        F = paper_flops(spec, batch)
        row = {"model": name, "params_b": spec.params / 1e9, "gpus": gpus, "tp": tp, "pp": pp,
               "dp": gpus // (tp * pp), "batch": batch, "published_tflops": published}
        for key, cluster in models.items():
            lay, t, mem = published_layout(spec, cluster, tp, pp, gpus, batch)
            pred = F / t["step"] / gpus / 1e12
            row[key] = {"predicted_tflops": pred, "error": pred / published - 1,
                        "layout": lay.label(), "memory_gb": mem["total"] / 1e9,
                        "split": {k: v / t["step"] for k, v in t.items() if k != "step"}}
        # the planner's own choice (default model), over ZeRO 0-1 and micro-batches 1, 2, 4
        feasible, _ = plan(spec, a100, gpus, batch, precision="fp16", micro_batches=[1, 2, 4],
                           zero=(0, 1), top=1)
        own = feasible[0].layout
        same = (own.tp, own.pp, own.dp, own.recompute, own.sp, own.zero) == (
            tp, pp, row["dp"], True, False, 0)
        row["planner_choice"] = own.label()
        row["planner_choice_is_published"] = same
        row["planner_choice_tflops"] = F / feasible[0].time["step"] / gpus / 1e12
        row["planner_choice_memory_gb"] = feasible[0].memory["total"] / 1e9
        row["cpu_seconds"] = time.process_time() - t0
        print(name, f"fixed {row['fixed']['predicted_tflops']:.0f}, per-op "
              f"{row['per-op']['predicted_tflops']:.0f} vs {published}; plan: {own.label()}",
              f"({row['cpu_seconds']:.1f} s CPU)", flush=True)
        rows.append(row)
    return rows


def zero_rows() -> list[dict]:
    from shardwise.planner.memory import zero_bytes

    rows = []
    for P, table in ZERO.items():
        for dp, published in table.items():
            for stage, pub in zip((1, 2, 3), published):
                pred = zero_bytes(P, dp, stage, "fp16")["total"] / 1e9
                rows.append({"params": P, "dp": dp, "stage": stage, "published_gb": pub,
                             "predicted_gb": pred, "error": pred / pub - 1})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "planner_results"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.process_time()
    meg, zero = megatron_rows(), zero_rows()
    lines = ["Megatron-LM weak scaling on DGX A100 80 GB (Narayanan et al. SC 2021, Table 1): "
             "teraFLOP/s per GPU in the paper's layout (tp x pp x dp, full recomputation, fp16)",
             "fixed: every matmul at 0.5 x 312 TFLOP/s, NVLink3 300 GB/s, HDR 200 Gb/s per GPU; "
             "per-op: GEMMs by size, memory-bound kernels by bytes (Calculon's A100 tables), "
             "Megatron-2021 kernels, links at Calculon's efficiencies",
             f"{'model':<15} {'GPUs':>5} {'tp':>2} {'pp':>3} {'dp':>3} {'published':>9} "
             f"{'fixed':>6} {'error':>6} {'per-op':>6} {'error':>6}  planner's choice "
             "(fixed model, TFLOP/s)"]
    for r in meg:
        f, o = r["fixed"], r["per-op"]
        choice = ("the published layout" if r["planner_choice_is_published"] else
                  f"{r['planner_choice']}")
        lines.append(f"{r['model']:<15} {r['gpus']:>5} {r['tp']:>2} {r['pp']:>3} {r['dp']:>3} "
                     f"{r['published_tflops']:>9} {f['predicted_tflops']:>6.0f} "
                     f"{f['error']:>+6.0%} {o['predicted_tflops']:>6.0f} {o['error']:>+6.0%}  "
                     f"{choice} ({r['planner_choice_tflops']:.0f})")
    for key in ("fixed", "per-op"):
        errs = [abs(r[key]["error"]) for r in meg]
        lines.append(f"{key}: worst |error| {max(errs):.0%}, mean {sum(errs) / len(errs):.1%}; "
                     f"rows within 10%: {sum(e <= 0.10 for e in errs)} of {len(errs)}")
    lines.append("layouts simulated (best micro-batch, schedule, cut per model):")
    for r in meg:
        lines.append(f"  {r['model']:<15} fixed: {r['fixed']['layout']}; "
                     f"per-op: {r['per-op']['layout']}")
    lines += ["", "ZeRO memory per device, GB (Rajbhandari et al. SC 2020, Table 1) vs "
              "planner.memory.zero_bytes (fp16, K = 12)",
              f"{'params':>8} {'dp':>5} {'stage':>5} {'published':>9} {'predicted':>9} {'error':>6}"]
    for r in zero:
        lines.append(f"{r['params'] / 1e9:>7g}B {r['dp']:>5} {r['stage']:>5} "
                     f"{r['published_gb']:>9g} {r['predicted_gb']:>9.3g} {r['error']:>+6.1%}")
    zw = max(abs(r["error"]) for r in zero)
    lines.append(f"worst |error| {zw:.1%} (the paper rounds to 3 significant figures)")
    lines.append(f"CPU time: {time.process_time() - t0:.1f} s")
    (out / "planner_published.json").write_text(json.dumps({"megatron": meg, "zero": zero},
                                                           indent=1))
    (out / "planner_published.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
