"""Our ZeRO stages against PyTorch's implementations, same GPT, same batches, dp=2.

Pairs (fp32, AdamW, gloo, 1 torch thread per rank, the GPT of configs/shakespeare.toml):

- ZeRO-1: ours vs ``torch.nn.parallel.DistributedDataParallel`` +
  ``torch.distributed.optim.ZeroRedundancyOptimizer`` (optimizer states sharded);
- ZeRO-2: ours vs FSDP2 ``fully_shard(reshard_after_forward=False)`` per block (gradients and
  optimizer states sharded, parameters kept between forward and backward);
- ZeRO-3: ours vs FSDP2 ``fully_shard`` per block (parameters sharded too).

- with ``--deepspeed``: each stage also against DeepSpeed's ZeRO of the same stage
  (``deepspeed.initialize``, torch AdamW, fp32; install with ``make bench-deps``).

Inside one job the implementations alternate (the order rotates every repeat); every run
builds a fresh model from the same seed and times ``--steps`` steps after ``--warmup``.
Prints the median tokens/s and the ratio ours / peer.

    python benchmarks/zero_vs_peers.py --repeats 5 --steps 20 [--deepspeed]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
PAIRS = {1: "ddp+ZeroRedundancyOptimizer", 2: "fsdp2(reshard_after_forward=False)", 3: "fsdp2"}


def _build(kind: str, stage: int, cfg, vocab: int):
    from shardwise.models import GPT, GPTConfig
    from shardwise.parallel.zero import ZeroDataParallel, ZeroStage3

    m = cfg.model
    torch.manual_seed(cfg.training.seed)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=m.block_size, n_layer=m.n_layer,
                          n_head=m.n_head, n_embd=m.n_embd))
    if kind == "deepspeed":
        import deepspeed

        ds_cfg = {"train_micro_batch_size_per_gpu": cfg.training.global_batch_size // dist.get_world_size(),
                  "gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_cfg, dist_init_required=False)
        return engine, None
    if kind == "ours":
        net = (ZeroStage3(model) if stage == 3
               else ZeroDataParallel(model, None, stage, cfg.parallel.bucket_mb))
        opt = torch.optim.AdamW(net.param_groups(0.0), lr=1e-3, foreach=False)
        return net, opt
    if stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.parallel.bucket_mb)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=1e-3, foreach=False)
        return net, opt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reshard = stage == 3
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def _run(kind: str, stage: int, cfg, tokens, steps: int, warmup: int) -> float:
    from shardwise.data import DistributedBatchSampler

    net, opt = _build(kind, stage, cfg, int(tokens.max()) + 1)
    sampler = DistributedBatchSampler(tokens, cfg.model.block_size, cfg.training.global_batch_size,
                                      dist.get_rank(), dist.get_world_size(), seed=cfg.training.seed)
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        x, y = sampler.next_batch()
        if kind == "deepspeed":
            _, loss = net(x, y)
            net.backward(loss)
            net.step()
        elif kind == "ours":
            net.zero_grad()
            _, loss = net(x, y)
            loss.backward()
            net.step(opt, 0.0)
        else:
            opt.zero_grad(set_to_none=True)
            _, loss = net(x, y)
            loss.backward()
            opt.step()
    dist.barrier()
    return steps * cfg.training.global_batch_size * cfg.model.block_size / (time.perf_counter() - t0)


def worker(cfg_dict: dict, stages: list[int], repeats: int, steps: int, warmup: int,
           kinds: tuple = ("ours", "peer")) -> dict:
    from shardwise.base.config import Config
    from shardwise.data import CharTokenizer, load_text

    cfg = Config.from_dict(cfg_dict)
    text = load_text(cfg.data.path)
    tokens = CharTokenizer.from_text(text).encode(text)
    out = {}
    for stage in stages:
        res = {k: [] for k in kinds}
        for r in range(repeats):
            for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:  # rotate who goes first
                res[kind].append(_run(kind, stage, cfg, tokens, steps, warmup))
        out[str(stage)] = res
    return out


def main(argv: list[str] | None = None) -> int:
    from shardwise.base.config import Config
    from shardwise.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs/shakespeare.toml"))
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deepspeed", action="store_true", help="also DeepSpeed's ZeRO (make bench-deps)")
    args = ap.parse_args(argv)
    kinds = ("ours", "peer")
    if args.deepspeed:
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            print("zero_vs_peers: error: --deepspeed needs DeepSpeed: run `make bench-deps`",
                  file=sys.stderr)
            return 2
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        kinds = ("ours", "peer", "deepspeed")
    cfg = Config.load(args.config, {"parallel.dp": 2})
    stages = [int(s) for s in args.stages.split(",")]
    res = spawn(worker, 2, (cfg.model_dump(), stages, args.repeats, args.steps, args.warmup, kinds),
                threads=1)[0]
    print(f"GPT {cfg.model.n_layer}x{cfg.model.n_embd}, batch {cfg.training.global_batch_size}"
          f"x{cfg.model.block_size} tokens, dp=2, fp32, 1 thread per rank, gloo, "
          f"{args.repeats} alternated repeats of {args.steps} steps (median tokens/s)")
    for s in stages:
        ours, peer = (statistics.median(res[str(s)][k]) for k in ("ours", "peer"))
        print(f"  ZeRO-{s}: ours {ours:8.0f}  vs  {PAIRS[s]:<36} {peer:8.0f}   ratio {ours / peer:.3f}")
        if "deepspeed" in kinds:
            ds = statistics.median(res[str(s)]["deepspeed"])
            print(f"          ours {ours:8.0f}  vs  {'deepspeed 0.19.8 stage ' + str(s):<36} {ds:8.0f}"
                  f"   ratio {ours / ds:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
