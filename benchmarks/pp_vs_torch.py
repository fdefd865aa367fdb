"""shardwise.parallel.pipeline against torch.distributed.pipelining on the same GPT, pp = 2.

Both sides get the same chunks (``StageChunk`` of one GPT built from one seed), the same
micro-batches, the same loss (mean cross-entropy over micro-batches) and AdamW; a step is
the whole schedule plus the optimizer step. Pairs: ours vs ``ScheduleGPipe``, ours 1f1b vs
``Schedule1F1B``, ours interleaved vs ``ScheduleInterleaved1F1B`` (v = 2). Each repeat runs
every side for ``--steps`` steps (after a warm-up step), alternating which goes first; the
median step time over all repeats is compared (ratio > 1: ours is faster). The first-step
losses of both sides are printed too: they must agree.

    .venv/bin/python benchmarks/pp_vs_torch.py --repeats 5 --steps 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from shardwise.base.topology import Topology, init_process_groups
from shardwise.engine import Engine, EngineConfig
from shardwise.launch import spawn
from shardwise.models import GPT, GPTConfig
from shardwise.parallel.pipeline.partition import balanced, gpt_layers
from shardwise.parallel.pipeline.stage import gpt_chunks, lm_loss

PAIRS = (("gpipe", "ScheduleGPipe", 1), ("1f1b", "Schedule1F1B", 1),
         ("interleaved", "ScheduleInterleaved1F1B", 2))


def _model(a) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=65, block_size=a["seq"], n_layer=a["layers"], n_head=4,
                         n_embd=a["embd"], tie_weights=False))


def _data(a, steps: int):
    g = torch.Generator().manual_seed(1)
    idx = [torch.randint(0, 65, (a["batch"], a["seq"]), generator=g) for _ in range(steps)]
    return [(i, (i + 1) % 65) for i in idx]


def _ours(a, kind: str, v: int, topo):
    engine = Engine(GPTConfig(vocab_size=65, block_size=a["seq"], n_layer=a["layers"], n_head=4,
                              n_embd=a["embd"], tie_weights=False), topo,
                    EngineConfig(
                        seq_len=a["seq"],
                        parallel={"schedule": kind, "micro_batches": a["m"], "chunks_per_rank": v},
                        optimizer={"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.01,
                                   "grad_clip": 0.0},
                        training={"seed": 0, "global_batch_size": a["batch"]}))
    return lambda idx, tgt: engine.train_step(idx, tgt)["loss"]


def _torch(a, sched_name: str, v: int, rank: int, p: int):
    from torch.distributed import pipelining as tpp

    model = _model(a)
    layers = gpt_layers(model)
    part = balanced([1.0] * len(layers), p * v)
    chunk_ids = [rank + i * p for i in range(v)]
    chunks = gpt_chunks(model, part, chunk_ids)
    stages = [tpp.PipelineStage(chunks[c], c, p * v, torch.device("cpu")) for c in chunk_ids]
    params = [q for c in chunks.values() for q in c.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    cls = getattr(tpp, sched_name)
    sched = cls(stages if v > 1 else stages[0], a["m"], loss_fn=lm_loss)
    last = (p * v - 1) % p == rank

    def step(idx, tgt):
        losses: list = []
        if rank == 0:
            sched.step(idx, target=tgt if last else None, losses=losses if last else None)
        else:
            sched.step(target=tgt if last else None, losses=losses if last else None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if losses else None

    return step


def _run(a: dict) -> dict:
    rank, p = dist.get_rank(), dist.get_world_size()
    topo = init_process_groups(Topology.build(1, p, 1, rank=rank, world_size=p))
    data = _data(a, a["steps"] + 1)
    out: dict = {}
    for kind, tname, v in PAIRS:
        sides = {f"ours {kind}": _ours(a, kind, v, topo), f"torch {tname}": _torch(a, tname, v, rank, p)}
        times = {k: [] for k in sides}
        first = {}
        for rep in range(a["repeats"]):
            for name in (list(sides) if rep % 2 == 0 else list(sides)[::-1]):
                fn = sides[name]
                for s, (idx, tgt) in enumerate(data):
                    dist.barrier()
                    t0 = time.perf_counter()
                    loss = fn(idx, tgt)
                    dt = time.perf_counter() - t0
                    if s == 0:
                        first.setdefault(name, loss)
                    else:
                        times[name].append(dt)
        out[kind] = {name: (statistics.median(ts), first[name]) for name, ts in times.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro-batches", dest="m", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    a = vars(ap.parse_args())
    res = spawn(_run, 2, (a,), threads=1)
    print(f"pp=2, GPT n_layer={a['layers']} n_embd={a['embd']} T={a['seq']} batch={a['batch']} "
          f"m={a['m']}; median step over {a['repeats']} x {a['steps']} steps (alternated)")
    for kind, _, _ in PAIRS:
        # every rank reports; rank 1 holds the last stage's loss (v=1) / rank 1 too for v=2
        rows = {name: (t, next((r[kind][name][1] for r in res if r[kind][name][1] is not None), None))
                for name, (t, _) in res[0][kind].items()}
        (ours, (to, lo)), (theirs, (tt, lt)) = rows.items()
        print(f"{ours:18} {to * 1e3:8.1f} ms   {theirs:26} {tt * 1e3:8.1f} ms   "
              f"ratio {tt / to:5.2f}x   first loss {lo:.5f} vs {lt:.5f}")


if __name__ == "__main__":
    main()
