"""Step-time cost of checkpointing every k steps, synchronous and asynchronous.

One spawn of ``--world-size`` local gloo ranks (1 torch thread each) trains a GPT
(``MODEL``, dp = world size, ZeRO-1) for ``--steps`` steps in three modes, ``--repeats``
times each, alternated so that load on the machine falls on all alike:

- ``none``: no checkpoint;
- ``sync``: ``Trainer.save_checkpoint`` every ``--every`` steps (``checkpoint.save``);
- ``async``: the same with ``checkpoint.async_save = true`` (the save call takes the
  logical tensors and returns; a background thread writes them).

Every iteration is timed with the save call inside it (the ranks start each step together);
the async mode's wait for its last write at the end is reported apart. Reported per mode:
the mean iteration time, the median, the blocking time of the save calls, and the cost per
checkpoint ``(total - total of none) / checkpoints``. Writes ``OUT/checkpoint_cost.json``
and ``OUT/checkpoint_cost.txt``.

    python benchmarks/checkpoint_cost.py --world-size 2 --steps 30 --every 5 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 64, "tie_weights": True}
BATCH = 16
MODES = ("none", "sync", "async")


def _config(mode: str, ws: int, steps: int, every: int, out: str) -> dict:
    from shardwise.base.config import Config

    return Config.from_dict({
        "model": MODEL, "parallel": {"dp": ws, "zero": 1},
        "optimizer": {"warmup_steps": 2},
        "training": {"steps": steps, "global_batch_size": BATCH, "eval_every": 0,
                     "progress": False, "sample_chars": 0, "out_dir": out},
        "checkpoint": {"every": every if mode != "none" else 0, "at_end": False, "keep": 2,
                       "async_save": mode == "async"}}).model_dump()


def worker(configs: list[dict]) -> list[dict]:
    from shardwise import comm
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.base.config import Config

    torch.set_num_threads(1)
    out = []
    for c in configs:
        cfg = Config.from_dict(c)
        trainer = build_trainer(cfg)
        every = cfg.checkpoint.every
        iters, saves = [], []
        for _ in range(cfg.training.steps):
            comm.barrier()  # every rank starts the step together
            t0 = time.perf_counter()
            trainer.train_step()
            if every and trainer.step % every == 0:
                s0 = time.perf_counter()
                trainer.save_checkpoint()
                saves.append(time.perf_counter() - s0)
            iters.append(time.perf_counter() - t0)
        w0 = time.perf_counter()
        trainer.wait_for_checkpoint()
        out.append({"iters": iters, "saves": saves, "final_wait_s": time.perf_counter() - w0,
                    "loss": trainer.history[-1]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "checkpoint_results"))
    args = ap.parse_args()
    from shardwise.engine.state import logical_tensors  # noqa: F401 (fail early if missing)
    from shardwise.launch import spawn

    tmp = Path(tempfile.mkdtemp(prefix="shardwise-ckpt-cost-"))
    plan = [(m, r) for r in range(args.repeats) for m in MODES]
    configs = [_config(m, args.world_size, args.steps, args.every, str(tmp / f"{m}{r}"))
               for m, r in plan]
    try:
        results = spawn(worker, args.world_size, (configs,))
    finally:
        ckpt_bytes = sum(f.stat().st_size for f in (tmp / "sync0" / "checkpoints").rglob("*")
                         if f.is_file()) // 2 if (tmp / "sync0").exists() else 0
        shutil.rmtree(tmp, ignore_errors=True)
    rows = {}
    for m in MODES:
        idx = [i for i, (mm, _) in enumerate(plan) if mm == m]
        # the slowest rank's iteration is the step time
        iters = [max(r[i]["iters"][k] for r in results) for i in idx
                 for k in range(args.steps)]
        saves = [max(r[i]["saves"][k] for r in results) for i in idx
                 for k in range(len(results[0][i]["saves"]))]
        rows[m] = {"mean_iter_s": statistics.mean(iters), "median_iter_s": statistics.median(iters),
                   "total_s": sum(iters) / args.repeats, "save_call_s": statistics.mean(saves) if saves else 0.0,
                   "final_wait_s": statistics.mean(max(r[i]["final_wait_s"] for r in results) for i in idx),
                   "loss": results[0][idx[0]]["loss"]}
    n_ckpt = args.steps // args.every
    for m in ("sync", "async"):
        rows[m]["cost_per_checkpoint_s"] = (rows[m]["total_s"] - rows["none"]["total_s"]) / n_ckpt
    n_params = sum(p.numel() for p in _model().parameters())
    info = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
            "torch": torch.__version__, "world_size": args.world_size, "threads_per_rank": 1,
            "model": MODEL, "parameters": n_params, "checkpoint_bytes": ckpt_bytes,
            "global_batch": BATCH, "steps": args.steps, "every": args.every,
            "repeats": args.repeats, "modes": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint_cost.json").write_text(json.dumps(info, indent=1))
    lines = [f"# benchmarks/checkpoint_cost.py --world-size {args.world_size} --steps {args.steps} "
             f"--every {args.every} --repeats {args.repeats}",
             f"# {info['machine']}, torch {info['torch']}, gloo, dp={args.world_size} ZeRO-1, "
             f"1 thread per rank; GPT {n_params / 1e6:.2f}M parameters, checkpoint "
             f"{ckpt_bytes / 2**20:.1f} MiB",
             f"{'mode':<6} {'mean step s':>12} {'median s':>9} {'save call s':>12} "
             f"{'cost/ckpt s':>12} {'final wait s':>13}"]
    for m in MODES:
        r = rows[m]
        lines.append(f"{m:<6} {r['mean_iter_s']:>12.4f} {r['median_iter_s']:>9.4f} "
                     f"{r['save_call_s']:>12.4f} {r.get('cost_per_checkpoint_s', 0.0):>12.4f} "
                     f"{r['final_wait_s']:>13.4f}")
    (out / "checkpoint_cost.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _model():
    from shardwise.models import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=65, **MODEL))


if __name__ == "__main__":
    main()
