"""`shardwise memory`'s prediction against the measured CUDA peak, one row per run.

    python benchmarks/gpu_memory.py --config configs/tiny.toml --parallel.dp 1
    python benchmarks/gpu_memory.py --config configs/tiny.toml --parallel.dp 1 \\
        --model.kind llama --model.n_layer 16 --model.n_embd 2048 --model.n_head 32 \\
        --model.n_kv_heads 8 --model.vocab_size 32768 --model.block_size 2048 \\
        --training.global_batch_size 4 --training.precision bf16 --steps 6 --label llama-1b

Trains ``--steps`` optimizer steps of a config (any ``--section.field value`` override, as
``shardwise train`` takes them) on CUDA, one rank per GPU (``shardwise.launch.spawn`` with
NCCL: dp x pp x cp x tp must not exceed the GPUs), the path ``shardwise train`` runs
(``apps.lm.Trainer``). For every rank it records:

- predicted: ``engine.memory.predict_rank`` (what ``shardwise memory --config`` prints:
  parameters, gradients and optimizer state held between steps, built on the meta device);
- held: ``Engine.memory_bytes()`` after the steps (the same categories measured on the
  rank's tensors) and ``torch.cuda.memory_allocated`` between steps (every tensor alive);
- peak: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the steps (the
  peaks are reset after the model is built and one warm-up step, so construction and
  first-step autotuning are not counted); the gap peak - predicted is what the prediction
  leaves out: activations, logits and the transient fp32 gradient copies of the step;
- outside the allocator: the device memory in use (``torch.cuda.mem_get_info``: total -
  free) less what PyTorch's caching allocator has reserved: the CUDA context, cuBLAS
  workspaces, NCCL's buffers (what ``planner.hardware.GPU_RESERVED``, the 2 GiB a plan
  leaves free, stands for; exact when the rank has the GPU to itself);
- speed: milliseconds per step and tokens/s over the timed steps (after the first).

Bytes in MiB (2**20). Results append to ``benchmarks/gpu_results/memory.json`` (a list of
rows) and rewrite ``memory.md`` from it. Without CUDA the script refuses in one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shardwise.base.config import Config, ConfigError  # noqa: E402
from shardwise.cli.common import split_overrides  # noqa: E402

MiB = 2 ** 20
RESULTS = ROOT / "benchmarks" / "gpu_results"


def measure(cfg_dict: dict, steps: int) -> dict:
    """Rank function (inside ``launch.spawn``): build the trainer, one warm-up step, reset
    the peaks, ``steps`` timed steps; this rank's predicted and measured bytes (MiB)."""
    import torch.distributed as dist

    from shardwise.apps.lm.trainer import Trainer
    from shardwise.base.topology import Topology, init_process_groups
    from shardwise.engine.memory import predict_rank

    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    topo = init_process_groups(Topology.build(p.dp, p.pp, p.tp, cp=p.cp, rank=dist.get_rank(),
                                              world_size=dist.get_world_size(), ep=p.ep))
    device = torch.device("cuda", torch.cuda.current_device())
    trainer = Trainer(cfg, topo, device)
    c = topo.coords
    pred = predict_rank(trainer.description, dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp,
                        dp_rank=c["dp"], pp_rank=c["pp"], tp_rank=c["tp"],
                        cp_rank=c.get("cp", 0), chunks_per_rank=p.chunks_per_rank, zero=p.zero,
                        precision=cfg.training.precision, bucket_mb=p.bucket_mb,
                        sequence_parallel=p.sequence_parallel, partition_by=p.partition,
                        ep=p.ep, state_bytes=8 if cfg.optimizer.state_dtype == "fp32" else 4,
                        offload=cfg.training.offload != "none",
                        offload_params=cfg.training.offload == "optimizer+params")
    trainer.train_step()  # warm-up: lazy buffers, optimizer state, autotuning
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        info = trainer.train_step(sync=False)
    loss = float(info["loss"])  # the one host synchronisation
    torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - t0) / steps
    held = trainer.engine.memory_bytes()
    free, total = torch.cuda.mem_get_info(device)
    return {"coords": c, "predicted_mib": {k: v / MiB for k, v in pred.items() if k != "padding"},
            "held_mib": {k: v / MiB for k, v in held.items()},
            "allocated_mib": torch.cuda.memory_allocated(device) / MiB,
            "peak_allocated_mib": torch.cuda.max_memory_allocated(device) / MiB,
            "peak_reserved_mib": torch.cuda.max_memory_reserved(device) / MiB,
            "device_total_mib": total / MiB,
            "outside_allocator_mib": (total - free - torch.cuda.memory_reserved(device)) / MiB,
            "ms_per_step": 1e3 * seconds,
            "tokens_per_s": trainer.samples_per_step / seconds, "loss": loss,
            "fp8_layers": len(trainer.engine.fp8_layers)}


def _row(cfg: Config, label: str, steps: int, ranks: list[dict], argv: list[str]) -> dict:
    m, p, t = cfg.model, cfg.parallel, cfg.training
    return {"label": label, "command": "python benchmarks/gpu_memory.py " + " ".join(argv),
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "host": platform.node(), "model": {"kind": m.kind, "n_layer": m.n_layer,
                                               "n_embd": m.n_embd, "n_head": m.n_head,
                                               "vocab_size": m.vocab_size,
                                               "block_size": m.block_size},
            "layout": {"dp": p.dp, "pp": p.pp, "tp": p.tp, "cp": p.cp, "zero": p.zero,
                       "micro_batches": p.micro_batches, "recompute": p.recompute},
            "precision": t.precision + (f" ({t.fp8_recipe})" if t.precision == "fp8" else ""),
            "compile": t.compile, "global_batch_size": t.global_batch_size, "steps": steps,
            "ranks": ranks}


def _markdown(rows: list[dict]) -> str:
    out = ["# `shardwise memory`'s prediction vs the measured CUDA peak", "",
           "Written by `benchmarks/gpu_memory.py` (one row per rank; MiB = 2**20 bytes). "
           "predicted: `engine.memory.predict_rank` (parameters, gradients, optimizer state "
           "between steps); held: `Engine.memory_bytes()` after the steps; peak: "
           "`torch.cuda.max_memory_allocated` / `max_memory_reserved` over the timed steps; "
           "gap = peak allocated - predicted (activations, logits, the step's transients); "
           "outside: device memory in use less the allocator's reservation (CUDA context, "
           "NCCL, cuBLAS; - where the run predates the column).", "",
           "| run | precision | rank (dp,pp,tp) | predicted | held | peak alloc | peak reserved "
           "| gap | outside | ms/step | tokens/s | device, torch |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        for k in r["ranks"]:
            c = k["coords"]
            outside = (f"{k['outside_allocator_mib']:,.1f}" if "outside_allocator_mib" in k
                       else "-")
            out.append(
                f"| {r['label']} | {r['precision']}{' compiled' if r['compile'] else ''} | "
                f"{c['dp']},{c['pp']},{c['tp']} | {k['predicted_mib']['total']:,.1f} | "
                f"{k['held_mib']['total']:,.1f} | {k['peak_allocated_mib']:,.1f} | "
                f"{k['peak_reserved_mib']:,.1f} | "
                f"{k['peak_allocated_mib'] - k['predicted_mib']['total']:,.1f} | {outside} | "
                f"{k['ms_per_step']:.1f} | {k['tokens_per_s']:,.0f} | "
                f"{r['device']}, {r['torch']} |")
    out += ["", "Commands:", ""] + [f"- {r['label']}: `{r['command']}`" for r in rows]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny.toml"))
    ap.add_argument("--steps", type=int, default=5, help="timed optimizer steps (after one)")
    ap.add_argument("--label", default=None, help="the row's name (default: the config's stem)")
    ap.add_argument("--dry", action="store_true", help="print the row; write nothing")
    args, extra = ap.parse_known_args(argv)
    if not torch.cuda.is_available():
        print("gpu_memory: error: needs CUDA (it measures torch.cuda's peak memory); no GPU "
              "is visible here", file=sys.stderr)
        return 2
    try:
        over = {"training.progress": False, "checkpoint.at_end": False,
                "training.sample_chars": 0, "training.device": "cuda",
                "training.out_dir": "/tmp/shardwise-gpu-memory", **split_overrides(extra)}
        cfg = Config.load(args.config, over)
        if cfg.training.precision == "fp8":
            from shardwise.parallel.float8 import check_fp8

            check_fp8("cuda", list(range(min(cfg.world_size, torch.cuda.device_count()))))
        if cfg.world_size > torch.cuda.device_count():
            raise ConfigError(f"the layout needs {cfg.world_size} ranks, one per GPU, but "
                              f"{torch.cuda.device_count()} GPU(s) are visible; use "
                              "--parallel.dp 1 (and pp, cp, tp 1) on one GPU")
    except (ConfigError, ValueError) as e:
        print(f"gpu_memory: error: {e}", file=sys.stderr)
        return 2
    from shardwise.launch import spawn

    ranks = spawn(measure, cfg.world_size, (cfg.model_dump(), args.steps), device="cuda")
    row = _row(cfg, args.label or Path(args.config).stem, args.steps, ranks, argv)
    print(json.dumps(row, indent=1))
    if args.dry:
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "memory.json"
    rows = json.loads(path.read_text()) if path.is_file() else []
    rows.append(row)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    tmp.replace(path)
    (RESULTS / "memory.md").write_text(_markdown(rows))
    print(f"wrote {path} and {RESULTS / 'memory.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
