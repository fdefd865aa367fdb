"""The planner beside GPU measurements: this repository's own (benchmarks/gpu_results/) and
published runs other than Megatron-LM 2021's (issue 44).

1. This repository's rows, one H100 SXM (NVIDIA H100 80GB HBM3), torch 2.11, blocks and
   loss compiled, fused AdamW, SDPA (cuDNN): the Llama-3.2-1B shape (gpu_llama.py's
   ``LLAMA_1B``) bf16 at 16 x 2048 tokens in 4 micro-batches and fp8 tensorwise
   (``cuda_llama1b.md``), bf16 at 4 x 2048 in one (``memory.json``); GPT-2 small (vocabulary
   50,304) compiled at 32 x 1024 in 2 micro-batches (``cuda.md``) and 64 x 1024 in 4
   (``cuda_b64_m4.md``). Predicted: ``simulate`` of that layout on ``dgx-h100`` (dp 1,
   ZeRO-0), the step in ms; memory: ``memory_of`` of compiled blocks and loss (the preset's
   ``Cluster.compiled``) against ``torch.cuda.max_memory_allocated``.
2. Published runs, each with its source: MosaicML llm-foundry's MPT throughput tables
   (``scripts/train/benchmarking/README.md``, "H100 80GB BF16" and "A100 80GB ... RoCE":
   FSDP FULL_SHARD, i.e. ZeRO-3 with no model parallelism, bf16, no activation
   checkpointing), tokens/s per GPU; predicted: that layout (dp = GPUs, ZeRO-3, the
   micro-batch size and gradient accumulation of the row) on ``dgx-h100`` / ``dgx-a100-80gb``.

The constants: ``hardware``'s FLASH_BACKWARD (measured: the profile), H100_GEMM_SCALE,
COMPILED_MEM, STEP_S and FP8_CAST (fitted, each on the row named in ``FITTED``, solved here
again by bisection and checked against the values in ``hardware.py``). Writes
``OUT/planner_measured.txt`` and ``.json``.

    python benchmarks/planner_measured.py --out benchmarks/planner_results
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30

# (label, model, global batch, micro-batches, fp8, measured ms/step, measured peak GiB,
#  source) -- one H100 SXM, torch 2.11.0+cu130
MEASURED = [
    ("Llama-1B bf16, 16 x 2048 in 4", "llama-1b", 16, 4, False, 530.8, 32.48,
     "benchmarks/gpu_results/cuda_llama1b.md, ours bf16"),
    ("Llama-1B fp8 tensorwise, 16 x 2048 in 4", "llama-1b", 16, 4, True, 476.9, 29.98,
     "benchmarks/gpu_results/cuda_llama1b.md, ours fp8 tensorwise"),
    ("Llama-1B bf16, 4 x 2048 in 1", "llama-1b", 4, 1, False, 148.5, 32.47,
     "benchmarks/gpu_results/memory.json, llama1b-bf16"),
    ("GPT-2 small bf16, 32 x 1024 in 2", "gpt2", 32, 2, False, 71.3, None,
     "benchmarks/gpu_results/cuda.md, + compile"),
    ("GPT-2 small bf16, 64 x 1024 in 4", "gpt2", 64, 4, False, 137.4, None,
     "benchmarks/gpu_results/cuda_b64_m4.md, + compile"),
]

# The row each fitted constant is solved on, by its step time (hardware.py says the same)
FITTED = {"H100_GEMM_SCALE": 0, "FP8_CAST": 1, "STEP_S": 2, "COMPILED_MEM": 3}

# Rows of this repository's measurements the planner does not price, and why
NOT_PRICED = [
    ("Llama-1B fp8 rowwise", 581.1, "training.fp8_recipe = rowwise: the planner prices the "
     "default recipe (tensorwise)"),
    ("Llama-1B bf16 + selective recompute", 830.8, "the engine refuses selective "
     "recomputation on CUDA until its GPU check has run; the planner's price (+2%) is far "
     "from the +57% measured"),
    ("GPT-2 small eager rows (baseline, + fused attention, + fused AdamW, + TF32)",
     99.2, "blocks not compiled: the GPU presets price compiled blocks (COMPILED_MEM)"),
    ("GPT-2 small fp32 rows", 592.6, "fp32 training: the planner plans bf16 / fp16"),
]

# MosaicML llm-foundry, scripts/train/benchmarking/README.md (MPT models: GPT blocks, no
# biases, MLP 4 h, vocabulary 50,368, tied embeddings, ALiBi), rows with FSDP FULL_SHARD
# and no activation checkpointing: (model, layers, width, heads, seq, GPUs, cluster,
# micro-batch, gradient accumulation, published tokens/s per GPU, table)
A100 = "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"
FOUNDRY = [
    ("mpt-1b", 24, 2048, 16, 2048, 8, "dgx-h100", 14, 1, 45455, "H100 80GB BF16"),
    ("mpt-7b", 32, 4096, 32, 2048, 8, "dgx-h100", 6, 1, 10643, "H100 80GB BF16"),
    ("mpt-13b", 40, 5120, 40, 2048, 8, "dgx-h100", 2, 1, 4792, "H100 80GB BF16"),
    ("mpt-760m", 24, 1536, 12, 2048, 8, "dgx-h100", 24, 2, 63147, "H100 80GB BF16"),
    ("mpt-3b", 32, 2560, 20, 2048, 16, "dgx-h100", 10, 3, 24142, "H100 80GB BF16"),
    ("mpt-13b", 40, 5120, 40, 2048, 8, "dgx-a100-80gb", 2, 3, 2262, A100),
    ("mpt-7b", 32, 4096, 32, 2048, 8, "dgx-a100-80gb", 6, 2, 4641, A100),
    ("mpt-3b", 32, 2560, 20, 2048, 8, "dgx-a100-80gb", 10, 2, 10811, A100),
    ("mpt-1b", 24, 2048, 16, 2048, 8, "dgx-a100-80gb", 14, 4, 20513, A100),
    ("mpt-760m", 24, 1536, 12, 2048, 8, "dgx-a100-80gb", 24, 2, 32434, A100),
]
FOUNDRY_FITTED = 2  # ZERO3_EXPOSED is solved on this row (MPT-13B, 8 H100s)
BOUND, PUBLISHED_BOUND = 0.10, 0.15  # |error| each priced row is held to (issue 44)
# Published rows the planner misses by more than PUBLISHED_BOUND, and the reason as far as
# it is known (tests/test_planner_measured.py holds them outside the bound, the others in)
KNOWN_MISSES = {
    3: "a small model on the H100: the same model on the A100 is +8%; llm-foundry's H100 "
       "table ran kernels older than the H100 (its own warning: torch 1.12-2.0 era), not "
       "modelled",
}
FOUNDRY_SOURCE = ("MosaicML llm-foundry, scripts/train/benchmarking/README.md "
                  "(github.com/mosaicml/llm-foundry)")


def specs() -> dict:
    from shardwise.planner.specs import NAMED, ModelSpec

    return {"llama-1b": ModelSpec("llama-1b", 16, 2048, 32, 128256, 2048, tie_weights=True,
                                  bias=False, n_kv_heads=8, ffn_hidden=8192, family="llama",
                                  rope_theta=500000.0),
            "gpt2": replace(NAMED["gpt2-124m"], vocab_size=50304)}


def measured_rows(cluster=None) -> list[dict]:
    """Each ``MEASURED`` row beside the planner's step and memory on ``cluster``
    (default: the ``dgx-h100`` preset)."""
    from shardwise.planner.hardware import PRESETS
    from shardwise.planner.search import memory_of
    from shardwise.planner.simulate import Layout, simulate

    cluster = cluster or PRESETS["dgx-h100"]
    sp = specs()
    rows = []
    for label, model, batch, m, fp8, ms, gib, source in MEASURED:
        lay = Layout(1, 1, 1, batch // m, m, fp8=fp8)
        t = simulate(sp[model], lay, cluster, "bf16")
        # the runs compiled blocks and loss (the GPU presets' Cluster.compiled)
        mem = memory_of(sp[model], lay, "bf16", compiled=cluster.compiled)["total"] / GiB
        rows.append({"row": label, "layout": lay.label(), "measured_ms": ms,
                     "predicted_ms": 1e3 * t["step"], "error": 1e3 * t["step"] / ms - 1,
                     "measured_gib": gib, "predicted_gib": mem,
                     "memory_error": None if gib is None else mem / gib - 1,
                     "fitted": [k for k, i in FITTED.items() if i == len(rows)],
                     "source": source})
    return rows


def eager(name: str, values: dict | None = None):
    """The ``name`` preset with eager blocks (llm-foundry's runs: no torch.compile);
    ``values``: the fitted constants of ``hardware`` to use instead of its own."""
    from shardwise.planner import hardware as hw

    saved = {k: getattr(hw, k) for k in (values or {})}
    try:
        for k, x in (values or {}).items():
            setattr(hw, k, x)
        scale = hw.H100_GEMM_SCALE if name == "dgx-h100" else hw.GEMM_SCALE
        return hw.per_op(hw.FIXED_PRESETS[name], "shardwise", scale, measured=True,
                         compiled=False)
    finally:
        for k, x in saved.items():
            setattr(hw, k, x)


def foundry_rows(values: dict | None = None) -> list[dict]:
    """Each ``FOUNDRY`` row beside the planner's tokens/s per GPU for its layout (eager
    blocks, ``eager``); ``values``: ``hardware``'s fitted constants to use instead (``fit``)."""
    from shardwise.planner.hardware import PRESETS
    from shardwise.planner.search import memory_of
    from shardwise.planner.simulate import Layout, simulate
    from shardwise.planner.specs import ModelSpec

    rows = []
    for name, L, h, a, s, gpus, cl, mb, ga, tps, table in FOUNDRY:
        spec = ModelSpec(name, L, h, a, 50368, s, tie_weights=True, bias=False)
        lay = Layout(gpus, 1, 1, mb, ga, zero=3)
        cluster = eager(cl, values)
        t = simulate(spec, lay, cluster, "bf16")
        pred = mb * ga * s / t["step"]
        hidden = mb * ga * s / simulate(spec, lay, replace(cluster, zero3_exposed=0.0),
                                        "bf16")["step"]
        rows.append({"row": f"{name} seq {s}, {gpus} GPUs, {cl}", "layout": lay.label(),
                     "published_tps": tps, "predicted_tps": pred, "error": pred / tps - 1,
                     "hidden_tps": hidden, "hidden_error": hidden / tps - 1,
                     "fitted": len(rows) == FOUNDRY_FITTED,
                     "dp_share": t["dp"] / t["step"],
                     "memory_gib": memory_of(spec, lay, "bf16")["total"] / GiB,  # eager
                     "source": f"{FOUNDRY_SOURCE}, table '{table}'"})
    return rows


def fit() -> dict:
    """The fitted constants solved again: each by bisection on its ``FITTED`` row, the
    others held, three rounds (they interact a little)."""
    from shardwise.planner import hardware as hw

    names = {"H100_GEMM_SCALE": (0.4, 1.0), "FP8_CAST": (0.0, 40.0), "STEP_S": (0.0, 0.05),
             "COMPILED_MEM": (0.05, 1.5), "ZERO3_EXPOSED": (0.0, 1.0)}
    values = {k: getattr(hw, k) for k in names}

    def cluster(v, compiled=True, name="dgx-h100"):
        saved = {k: getattr(hw, k) for k in names}
        try:
            for k, x in v.items():
                setattr(hw, k, x)
            return hw.per_op(hw.FIXED_PRESETS[name], "shardwise",
                             v["H100_GEMM_SCALE"] if name == "dgx-h100" else hw.GEMM_SCALE,
                             measured=True, compiled=compiled)
        finally:
            for k, x in saved.items():
                setattr(hw, k, x)

    def err(v, k):
        if k == "ZERO3_EXPOSED":  # on a published row: tokens/s, so the sign flips
            return -foundry_rows(v)[FOUNDRY_FITTED]["error"]
        return measured_rows(cluster(v))[FITTED[k]]["error"]

    for _ in range(4):
        for k, (lo, hi) in names.items():
            # the predicted step falls as the GEMM scale grows, rises with the others
            falls = k == "H100_GEMM_SCALE"
            for _ in range(40):
                mid = (lo + hi) / 2
                e = err({**values, k: mid}, k)
                if (e > 0) == falls:
                    lo = mid
                else:
                    hi = mid
            values[k] = (lo + hi) / 2
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "planner_results"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from shardwise.planner import hardware as hw

    solved = fit()
    for k, v in solved.items():  # the constants in hardware.py are these
        assert abs(v / getattr(hw, k) - 1) < 0.01, (k, v, getattr(hw, k))
    meas, pub = measured_rows(), foundry_rows()
    lines = ["This repository's GPU measurements (one H100 SXM) beside the planner (dgx-h100)",
             f"{'row':<42} {'layout':<24} {'measured':>9} {'predicted':>9} {'error':>7}"
             f" {'peak GiB':>8} {'pred GiB':>8} {'error':>7}  fitted here"]
    for r in meas:
        me = "" if r["memory_error"] is None else f"{r['memory_error']:>+7.1%}"
        mg = "" if r["measured_gib"] is None else f"{r['measured_gib']:>8.2f}"
        lines.append(f"{r['row']:<42} {r['layout']:<24} {r['measured_ms']:>9.1f} "
                     f"{r['predicted_ms']:>9.1f} {r['error']:>+7.1%} {mg:>8} "
                     f"{r['predicted_gib']:>8.2f} {me:>7}  " + ", ".join(r["fitted"]))
    lines += ["", "Not priced:"] + [f"  {n} ({ms} ms): {why}" for n, ms, why in NOT_PRICED]
    lines += ["", f"Published: {FOUNDRY_SOURCE}; FSDP FULL_SHARD (ZeRO-3), bf16, no "
              "activation checkpointing; tokens/s per GPU",
              f"{'row':<40} {'layout':<24} {'published':>9} {'predicted':>9} {'error':>7} "
              f"{'dp share':>8} {'GiB':>6} {'hidden':>7} {'error':>7}  (hidden: ZeRO-3's "
              "collectives hidden by prefetch, as before ZERO3_EXPOSED)"]
    for i, r in enumerate(pub):
        note = ("  ZERO3_EXPOSED fitted here" if r["fitted"] else
                f"  outside {PUBLISHED_BOUND:.0%}: {KNOWN_MISSES[i]}" if i in KNOWN_MISSES else "")
        lines.append(f"{r['row']:<40} {r['layout']:<24} {r['published_tps']:>9} "
                     f"{r['predicted_tps']:>9.0f} {r['error']:>+7.1%} {r['dp_share']:>8.1%} "
                     f"{r['memory_gib']:>6.1f} {r['hidden_tps']:>7.0f} "
                     f"{r['hidden_error']:>+7.1%}{note}")
    inside = [r for i, r in enumerate(pub) if i not in KNOWN_MISSES and not r["fitted"]]
    lines.append(f"predicted (not fitted) published rows within {PUBLISHED_BOUND:.0%}: "
                 f"{sum(abs(r['error']) <= PUBLISHED_BOUND for r in inside)} of "
                 f"{len(pub) - 1}; worst of those {max(abs(r['error']) for r in inside):.1%}")
    lines += ["", "Constants: FLASH_BACKWARD = %.2f (measured); fitted (%d): " % (
        hw.FLASH_BACKWARD, len(solved)) + ", ".join(
        f"{k} = {v:.4g} (hardware.py {getattr(hw, k):.4g})" for k, v in solved.items())]
    (out / "planner_measured.json").write_text(json.dumps(
        {"measured": meas, "published": pub, "fitted": solved,
         "not_priced": NOT_PRICED}, indent=1))
    (out / "planner_measured.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
