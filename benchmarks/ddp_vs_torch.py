"""Our DDP against torch.nn.parallel.DistributedDataParallel on the same GPT and data.

Both wrap the model of ``configs/shakespeare.toml`` and train on the same Shakespeare
batches at dp=2 (1 torch thread per rank, gloo). Inside one job the two implementations
alternate, ``--repeats`` times each, every run building a fresh model from the same seed
and timing ``--steps`` steps after ``--warmup`` untimed ones. Prints the median tokens/s
of each and the ratio ours / torch.

    python benchmarks/ddp_vs_torch.py                  # dp=2, 5 repeats of 30 steps
    python benchmarks/ddp_vs_torch.py --allreduce ring --repeats 7

Each side resets gradients its own recommended way: ours with ``DistributedDataParallel
.zero_grad()`` (buckets zeroed in place), torch's with ``optimizer.zero_grad()``
(``set_to_none=True``; its DDP runs with default options, its ``bucket_cap_mb`` set to
our ``bucket_mb``, both MiB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]


def _run(kind: str, cfg, tokens, steps: int, warmup: int) -> float:
    from shardwise.data import DistributedBatchSampler
    from shardwise.models import GPT, GPTConfig
    from shardwise.parallel.data_parallel import DistributedDataParallel

    m, rank, world = cfg.model, dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.training.seed)
    model = GPT(GPTConfig(vocab_size=int(tokens.max()) + 1, block_size=m.block_size,
                          n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd))
    if kind == "ours":
        net = DistributedDataParallel(model, None, cfg.parallel.bucket_mb, cfg.parallel.allreduce,
                                      first_bucket_mb=cfg.parallel.first_bucket_mb)
    else:
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.parallel.bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    sampler = DistributedBatchSampler(tokens, m.block_size, cfg.training.global_batch_size,
                                      rank, world, seed=cfg.training.seed)
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        x, y = sampler.next_batch()
        if kind == "ours":
            net.zero_grad()  # ours: zero the buckets in place, grads stay bucket views
        else:
            opt.zero_grad(set_to_none=True)  # torch's default and recommended reset
        _, loss = net(x, y)
        loss.backward()
        opt.step()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    return steps * cfg.training.global_batch_size * m.block_size / elapsed


def worker(cfg_dict: dict, repeats: int, steps: int, warmup: int) -> dict:
    from shardwise.base.config import Config
    from shardwise.data import CharTokenizer, load_text

    cfg = Config.from_dict(cfg_dict)
    text = load_text(cfg.data.path)
    tokens = CharTokenizer.from_text(text).encode(text)
    out: dict[str, list[float]] = {"ours": [], "torch": []}
    for r in range(repeats):
        order = ("ours", "torch") if r % 2 == 0 else ("torch", "ours")  # alternate who goes first
        for kind in order:
            out[kind].append(_run(kind, cfg, tokens, steps, warmup))
    return out


def main(argv: list[str] | None = None) -> int:
    from shardwise.base.config import Config
    from shardwise.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs/shakespeare.toml"))
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--allreduce", default=None, help="algorithm for our DDP (default: config)")
    ap.add_argument("--json", help="also write the raw measurements here")
    args = ap.parse_args(argv)
    overrides = {"parallel.dp": args.dp}
    if args.allreduce:
        overrides["parallel.allreduce"] = args.allreduce
    cfg = Config.load(args.config, overrides)
    res = spawn(worker, args.dp, (cfg.model_dump(), args.repeats, args.steps, args.warmup),
                threads=1)[0]
    ours, theirs = statistics.median(res["ours"]), statistics.median(res["torch"])
    print(f"GPT {cfg.model.n_layer}x{cfg.model.n_embd}, global batch {cfg.training.global_batch_size}"
          f"x{cfg.model.block_size} tokens, dp={args.dp}, 1 thread per rank, gloo, "
          f"{args.repeats} alternated repeats of {args.steps} steps, allreduce={cfg.parallel.allreduce}")
    print(f"  shardwise DDP : {ours:9.0f} tokens/s (median; runs {[round(v) for v in res['ours']]})")
    print(f"  torch DDP     : {theirs:9.0f} tokens/s (median; runs {[round(v) for v in res['torch']]})")
    print(f"  ratio ours/torch = {ours / theirs:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"ours": res["ours"], "torch": res["torch"],
                                               "ratio": ours / theirs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
