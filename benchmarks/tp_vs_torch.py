"""Our tensor parallelism against ``torch.distributed.tensor.parallel`` on the same GPT.

Both split the GPT of ``configs/shakespeare.toml`` (by default) across tp=2 gloo ranks, 1
torch thread per rank, and train it on the same Shakespeare batches (every tp rank sees the
whole batch). Ours: the engine's tp shard (``engine.model.build_local_model``, pp = 1:
Q/K/V and ``fc`` column-parallel, ``out_proj`` and ``proj`` row-parallel, vocab-parallel
embedding, LM head and cross-entropy). Torch's: ``parallelize_module`` on a CPU ``DeviceMesh`` with
``ColwiseParallel`` on Q/K/V and ``fc`` and ``RowwiseParallel`` on ``out_proj`` and
``proj``; its embedding and head stay replicated (they are tied, and the character vocabulary
is small, so they cost little). Inside one job the two alternate, ``--repeats`` times each,
every run building a fresh model from the same seed and timing ``--steps`` training steps
(forward, backward, AdamW) after ``--warmup`` untimed ones. Prints the median tokens/s of
each, the ratio ours / torch (of the medians, and the median of the back-to-back pairs,
which is steadier when other jobs share the cores), and both first-step losses (they must
agree).

    python benchmarks/tp_vs_torch.py                     # tp=2, 5 repeats of 20 steps
    python benchmarks/tp_vs_torch.py --sequence-parallel --repeats 7
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


def _torch_tp(model, tp: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (tp,))
    plan = {}
    for i in range(len(model.blocks)):
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.out_proj"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.fc"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.proj"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _run(kind: str, gcfg, seed: int, batches: list, steps: int, warmup: int,
         sp: bool, allreduce: str = "native") -> tuple[float, float]:
    from shardwise.base.topology import Topology, init_process_groups
    from shardwise.engine.model import build_local_model
    from shardwise.models import GPT
    from shardwise.parallel.tensor_parallel import RankGroup, sync_replicated_grads

    world = dist.get_world_size()
    if kind == "ours":
        topo = init_process_groups(Topology.build(tp=world, rank=dist.get_rank(),
                                                  world_size=world))
        tp = RankGroup.from_topology(topo, sequence_parallel=sp, all_reduce=allreduce)
        local = build_local_model(gcfg, pp=1, pp_rank=0, chunk_ids=[0], n_chunks=1, tp=tp,
                                  seed=seed, dropout_seed=seed, device=torch.device("cpu"))
        model = local.chunks[0]
        loss_of = lambda x, y: local.loss_fn(model(x), y)
    else:
        torch.manual_seed(seed)
        model = _torch_tp(GPT(gcfg), world)
        loss_of = lambda x, y: model(x, y)[1]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    first_loss = None
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = loss_of(x, y)
        loss.backward()
        if kind == "ours" and sp:
            sync_replicated_grads(model.parameters(), tp)
        opt.step()
        if first_loss is None:
            first_loss = float(loss.detach())
    dist.barrier()
    elapsed = time.perf_counter() - t0
    x = batches[0][0]
    return steps * x.numel() / elapsed, first_loss


def worker(cfg_dict: dict, repeats: int, steps: int, warmup: int, batch: int, sp: bool,
           allreduce: str = "native") -> dict:
    from shardwise import comm
    from shardwise.base.config import Config
    from shardwise.data import CharTokenizer, load_text
    from shardwise.models import GPTConfig

    comm.configure(check=False)  # shapes are fixed by construction; no agreement rounds
    cfg = Config.from_dict(cfg_dict)
    m = cfg.model
    text = load_text(cfg.data.path)
    tokens = CharTokenizer.from_text(text).encode(text)
    gcfg = GPTConfig(vocab_size=int(tokens.max()) + 1, block_size=m.block_size,
                     n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd,
                     tie_weights=m.tie_weights)
    g = torch.Generator().manual_seed(cfg.training.seed)
    batches = []
    for _ in range(8):
        starts = torch.randint(0, len(tokens) - m.block_size - 1, (batch,), generator=g)
        batches.append((torch.stack([tokens[s:s + m.block_size] for s in starts]),
                        torch.stack([tokens[s + 1:s + m.block_size + 1] for s in starts])))
    out: dict[str, list] = {"ours": [], "torch": [], "loss_ours": [], "loss_torch": []}
    for r in range(repeats):
        order = ("ours", "torch") if r % 2 == 0 else ("torch", "ours")  # alternate who goes first
        for kind in order:
            tps, loss = _run(kind, gcfg, cfg.training.seed, batches, steps, warmup, sp,
                             allreduce)
            out[kind].append(tps)
            out[f"loss_{kind}"].append(loss)
    return out


def main(argv: list[str] | None = None) -> int:
    from shardwise.base.config import Config
    from shardwise.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs/shakespeare.toml"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step (every tp rank)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sequence-parallel", action="store_true", help="ours with SP")
    ap.add_argument("--allreduce", default="native", help="our TP's all-reduce algorithm "
                    "(shardwise.comm: native, auto, shm, ring, ...)")
    ap.add_argument("--json", help="also write the raw measurements here")
    args = ap.parse_args(argv)
    cfg = Config.load(args.config, {"parallel.dp": 1})  # only model, data and seed are used
    res = spawn(worker, args.tp, (cfg.model_dump(), args.repeats, args.steps, args.warmup,
                                  args.batch, args.sequence_parallel, args.allreduce),
                threads=1)[0]
    ours, theirs = statistics.median(res["ours"]), statistics.median(res["torch"])
    m = cfg.model
    print(f"GPT {m.n_layer}x{m.n_embd} ({m.n_head} heads), batch {args.batch}x{m.block_size} "
          f"tokens, tp={args.tp}, sequence_parallel={args.sequence_parallel}, all-reduce "
          f"{args.allreduce}, 1 thread per "
          f"rank, gloo, {args.repeats} alternated repeats of {args.steps} steps")
    print(f"  shardwise TP : {ours:9.0f} tokens/s (median; runs {[round(v) for v in res['ours']]})")
    print(f"  torch TP     : {theirs:9.0f} tokens/s (median; runs {[round(v) for v in res['torch']]})")
    paired = statistics.median(a / b for a, b in zip(res["ours"], res["torch"]))
    print(f"  ratio ours/torch = {ours / theirs:.3f} (medians); {paired:.3f} (median of the "
          f"{args.repeats} back-to-back pairs)")
    print(f"  first-step loss: ours {res['loss_ours'][0]:.6f}, torch {res['loss_torch'][0]:.6f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res | {"ratio": ours / theirs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
