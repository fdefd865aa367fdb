"""Bytes per rank on the device and in host memory under ``training.offload``: what
``shardwise memory`` predicts (``engine.memory.predict_rank``) beside what the engine
itself holds after two steps (``Engine.memory_bytes``, counted from its tensors).

One spawn of 2 local gloo ranks (1 torch thread each) trains a 4 x 128 GPT (tied, context
64) two steps in each of: ZeRO-1 and ZeRO-3, fp32 and bf16 compute, without offload, with
``"optimizer"`` and (ZeRO-3) with ``"optimizer+params"``. A row per (run, dp rank): the
predicted and the measured device bytes (``total - host``) and host bytes. On the CPU the
"device" is host memory too: the split is the engine's own accounting of what it keeps where
on a GPU, not a measurement of two memories (peak allocated on CUDA: ``gpu_memory.py``).

    python benchmarks/offload_memory.py --out benchmarks/offload_results
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "tie_weights": True}
RUNS = [(zero, precision, offload) for zero in (1, 3) for precision in ("fp32", "bf16")
        for offload in ("none", "optimizer", "optimizer+params")
        if zero == 3 or offload != "optimizer+params"]


def _config(zero: int, precision: str, offload: str) -> dict:
    from shardwise.base.config import Config

    return Config.from_dict({
        "model": MODEL, "parallel": {"dp": 2, "zero": zero},
        "optimizer": {"warmup_steps": 1},
        "training": {"steps": 2, "global_batch_size": 8, "eval_every": 0, "progress": False,
                     "sample_chars": 0, "precision": precision, "offload": offload,
                     "out_dir": "/tmp/shardwise-offload-memory"},
        "checkpoint": {"at_end": False}}).model_dump()


def worker(configs: list[dict]) -> list[dict]:
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.base.config import Config

    torch.set_num_threads(1)
    out = []
    for c in configs:
        trainer = build_trainer(Config.from_dict(c))
        for _ in range(trainer.cfg.training.steps):
            trainer.train_step()
        out.append({"memory": trainer.engine.memory_bytes(), "coords": trainer.topology.coords})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/offload_results"))
    args = ap.parse_args()
    from shardwise.base.config import Config
    from shardwise.engine.memory import predict_rank
    from shardwise.launch import spawn
    from shardwise.planner.specs import describe_config

    configs = [_config(*run) for run in RUNS]
    ranks = spawn(worker, 2, (configs,))
    w = 11  # bytes columns
    lines = [f"{'zero':>4} {'prec':>4} {'offload':>16} {'dp':>2} {'pred dev':>{w}} "
             f"{'meas dev':>{w}} {'pred host':>{w}} {'meas host':>{w}} equal"]
    for i, (zero, precision, offload) in enumerate(RUNS):
        d = describe_config(Config.from_dict(configs[i]))
        for r in ranks:
            got, dp = r[i]["memory"], r[i]["coords"]["dp"]
            pred = predict_rank(d, dp=2, dp_rank=dp, zero=zero, precision=precision,
                                offload=offload != "none",
                                offload_params=offload == "optimizer+params")
            dev = (pred["total"] - pred["host"], got["total"] - got["host"])
            same = dev[0] == dev[1] and pred["host"] == got["host"]
            lines.append(f"{zero:>4} {precision:>4} {offload:>16} {dp:>2} {dev[0]:>{w},} "
                         f"{dev[1]:>{w},} {pred['host']:>{w},} {got['host']:>{w},} "
                         f"{'yes' if same else 'NO'}")
    text = (f"{MODEL['n_layer']} x {MODEL['n_embd']} GPT (tied, context "
            f"{MODEL['block_size']}), dp2, after 2 steps; bytes per rank, device = total - "
            "host (Engine.memory_bytes) against predict_rank (shardwise memory); torch "
            f"{torch.__version__}, CPU\n" + "\n".join(lines) + "\n")
    print(text, end="")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offload_memory.txt").write_text(text)


if __name__ == "__main__":
    main()
