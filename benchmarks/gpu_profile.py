"""Where a training step's GPU time goes: the kernels of a few steps of the engine, by total
device time (torch.profiler), for the Llama of ``gpu_llama.py`` or the GPT-2 small of
``gpu_mfu.py``.

    python benchmarks/gpu_profile.py --model llama1b --micro-batches 4
    python benchmarks/gpu_profile.py --model gpt2 --batch 32 --micro-batches 2

Prints the top kernels with their share of the device time, and the step's wall time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from shardwise.base.topology import Topology  # noqa: E402
from shardwise.engine import Engine, EngineConfig  # noqa: E402
from shardwise.models import GPTConfig  # noqa: E402
from shardwise.models.llama import LlamaConfig  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("llama1b", "gpt2"), default="llama1b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_profile.py: needs CUDA", file=sys.stderr)
        return 2
    if a.model == "llama1b":
        from gpu_llama import LLAMA_1B
        cfg = LlamaConfig(**LLAMA_1B)
    else:
        from gpu_mfu import GPT2_SMALL
        cfg = GPTConfig(**GPT2_SMALL, attention="sdpa")
    torch.set_float32_matmul_precision("high")
    s = EngineConfig(
        seq_len=cfg.block_size, parallel={"micro_batches": a.micro_batches},
        optimizer={"lr": 3e-4, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1, "grad_clip": 1.0,
                   "fused": True},
        training={"precision": a.precision, "seed": 0, "global_batch_size": a.batch,
                  "compile": not a.no_compile})
    dev = torch.device("cuda", 0)
    engine = Engine(cfg, Topology.build(1, 1, 1), s, dev)
    x = torch.randint(0, cfg.vocab_size, (a.batch, cfg.block_size + 1), device=dev)
    idx, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    for _ in range(4):
        engine.train_step(idx, tgt, sync=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        engine.train_step(idx, tgt, sync=False)
    torch.cuda.synchronize()
    print(f"{a.model}: {(time.perf_counter() - t0) / 3 * 1e3:.1f} ms/step unprofiled")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            engine.train_step(idx, tgt, sync=False)
        torch.cuda.synchronize()
    # kernels only (CPU-side ops also carry their kernels' device time: counted once here)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) or 1
    events.sort(key=lambda e: -e.self_device_time_total)
    print(f"device time {total / 2e3:.1f} ms/step over {len(events)} kernels")
    for e in events[:a.top]:
        print(f"{100 * e.self_device_time_total / total:5.1f}% {e.self_device_time_total / 2e3:8.2f} ms "
              f"x{e.count // 2:<5d} {e.key[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
