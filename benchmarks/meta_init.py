"""Peak resident memory per rank while building this rank's part of a GPT.

One spawn of 4 local gloo ranks (dp 1 x pp 2 x tp 2, 1 torch thread each) per mode, since
``ru_maxrss`` is a process's lifetime peak; each rank reports its peak rise over the measured
call (``ru_maxrss`` after minus ``VmRSS`` before, bytes), the bytes of parameters it holds and the time taken:

- ``full``: ``torch.manual_seed(seed); GPT(cfg)``, what every rank did first before meta
  construction (a lower bound of the old path's peak: the whole model on every rank);
- ``local``: ``engine.model.build_local_model`` (GPT on meta, this rank's layers sharded,
  materialised and given the single-process values by replaying the init stream);
- ``engine``: the whole ``Engine`` (the above, then DDP gradient buckets and the
  optimizer's fp32 masters, which add about two more copies of what the rank holds).

Before the measured call each rank builds a tiny GPT on meta once: the first meta
construction imports torch's meta kernels and decompositions (a fixed ~75 MiB whatever the
model, reported apart as ``imports``; code, not model).

Writes ``OUT/meta_init.json`` and ``OUT/meta_init.txt``.

    python benchmarks/meta_init.py --n-layer 8 --n-embd 1024 --vocab 8192
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from pathlib import Path

import torch

MODES = ("full", "local", "engine")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _now() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def rank_worker(mode: str, gpt: dict, pp: int, tp: int, seed: int) -> dict:
    import torch.distributed as dist

    from shardwise.base.topology import Topology, init_process_groups
    from shardwise.engine.engine import Engine, EngineSettings
    from shardwise.engine.model import build_local_model
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.parallel.tensor_parallel.group import RankGroup

    torch.set_num_threads(1)
    cfg = GPTConfig(**gpt)
    topo = init_process_groups(Topology.build(1, pp, tp, rank=dist.get_rank(),
                                              world_size=dist.get_world_size()))
    # the first meta construction imports ~800 torch modules (meta kernels, decompositions),
    # a fixed cost whatever the model; measured apart so the rise is the model's own
    from shardwise.models.meta_init import record_init
    warm = _now()
    record_init(lambda: GPT(GPTConfig(vocab_size=8, n_layer=1, n_head=1, n_embd=8)))
    imports = _now() - warm
    before, t0 = _now(), time.perf_counter()
    if mode == "full":
        torch.manual_seed(seed)
        params = list(GPT(cfg).parameters())
    elif mode == "local":
        group = RankGroup.from_topology(topo) if tp > 1 else RankGroup()
        local = build_local_model(cfg, pp=pp, pp_rank=topo.pp_rank, chunk_ids=[topo.pp_rank],
                                  n_chunks=pp, tp=group, seed=seed, dropout_seed=0,
                                  device=torch.device("cpu"))
        params = [p for _, p in local.named_parameters()]
    else:
        s = EngineSettings(micro_batches=2, seed=seed, batch_size=8, seq_len=cfg.block_size)
        engine = Engine(cfg, topo, s, torch.device("cpu"))
        params = [p for _, p in engine.local.named_parameters()]
    secs = time.perf_counter() - t0
    return {"rise": _peak() - before, "held": sum(p.numel() * p.element_size() for p in params),
            "seconds": secs, "imports": imports}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "meta_init_results")
    a = ap.parse_args()
    from shardwise.launch import spawn
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.models.meta_init import record_init

    gpt = {"vocab_size": a.vocab, "n_layer": a.n_layer, "n_head": a.n_head,
           "n_embd": a.n_embd, "block_size": 64}
    model = record_init(lambda: GPT(GPTConfig(**gpt))).model
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    largest = 4 * max(p.numel() for p in model.parameters())
    mib = lambda b: b / 2**20
    head = (f"GPT {gpt}: {mib(model_bytes):.1f} MiB of fp32 parameters, largest tensor "
            f"{mib(largest):.1f} MiB; 4 ranks, pp 2 x tp 2; torch {torch.__version__}, "
            f"{platform.machine()}")
    columns = (f"{'mode':<7} {'rank':>4} {'held MiB':>9} {'peak rise MiB':>14} "
               f"{'rise/held':>9} {'seconds':>8} {'imports MiB':>11}")
    lines = [head, columns]
    results = {"gpt": gpt, "model_bytes": model_bytes, "largest_tensor_bytes": largest}
    for mode in MODES:
        rows = spawn(rank_worker, 4, (mode, gpt, 2, 2, 1337))
        results[mode] = rows
        for r, row in enumerate(rows):
            lines.append(f"{mode:<7} {r:>4} {mib(row['held']):>9.1f} {mib(row['rise']):>14.1f} "
                         f"{row['rise'] / row['held']:>9.2f} {row['seconds']:>8.2f} "
                         f"{mib(row['imports']):>11.1f}")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "meta_init.json").write_text(json.dumps(results, indent=1))
    (a.out / "meta_init.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
