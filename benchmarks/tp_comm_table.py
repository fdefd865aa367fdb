"""Print seed 000's comparison of communication per step (data vs tensor parallelism for
y = Wx), measured from ``shardwise.comm``'s byte counters, and the per-layer communication
of one step of the tensor-parallel GPT with and without sequence parallelism.

    python benchmarks/tp_comm_table.py                       # 2 ranks, B=8, C_in=32, C_out=48
    python benchmarks/tp_comm_table.py --ranks 4 --batch 64 --c-in 1024 --c-out 4096

Collectives run with our ring algorithms (``native`` ones move bytes the counters cannot
see). Elements are the collectives' message sizes; bytes are what this rank (rank 0) sent.
"""

from __future__ import annotations

import argparse
import sys

import torch.distributed as dist


def worker(batch: int, c_in: int, c_out: int, gpt: dict) -> dict:
    import torch

    from shardwise.base.topology import Topology, init_process_groups
    from shardwise.engine.model import build_local_model
    from shardwise.models.gpt import GPTConfig
    from shardwise.parallel.tensor_parallel import RankGroup
    from shardwise.parallel.tensor_parallel.comm_table import measure_gpt_layers, measure_linear

    n, rank = dist.get_world_size(), dist.get_rank()
    dp = init_process_groups(Topology.build(dp=n, rank=rank, world_size=n))
    tp_topo = init_process_groups(Topology.build(tp=n, rank=rank, world_size=n))
    tp = RankGroup.from_topology(tp_topo, all_reduce="ring", gather="ring")
    out = {"linear": measure_linear(batch, c_in, c_out, dp.groups.dp, tp)}
    cfg = GPTConfig(**gpt)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g)
    for sp in (False, True):
        tps = RankGroup.from_topology(tp_topo, sequence_parallel=sp, all_reduce="ring",
                                      gather="ring")
        local = build_local_model(cfg, pp=1, pp_rank=0, chunk_ids=[0], n_chunks=1, tp=tps,
                                  seed=0, dropout_seed=0, device=torch.device("cpu"))
        out[f"gpt sp={sp}"] = measure_gpt_layers(
            lambda x, y: local.loss_fn(local.chunks[0](x), y), x, x)
    return out


def main(argv: list[str] | None = None) -> int:
    from shardwise.comm.accounting import format_table
    from shardwise.launch import spawn
    from shardwise.parallel.tensor_parallel.comm_table import COLUMNS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--c-in", type=int, default=32)
    ap.add_argument("--c-out", type=int, default=48)
    args = ap.parse_args(argv)
    gpt = {"vocab_size": 65, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32}
    res = spawn(worker, args.ranks, (args.batch, args.c_in, args.c_out, gpt), threads=1)[0]
    print(f"y = Wx, B={args.batch}, C_in={args.c_in}, C_out={args.c_out}, {args.ranks} ranks "
          f"(rank 0's counters; seed 000: DP C_in*C_out, TP partition output B*C_out, "
          f"TP reduce output B*C_in)")
    print(format_table(res["linear"], COLUMNS))
    for sp in (False, True):
        print(f"\nGPT {gpt}, batch 4 x {gpt['block_size']}, one step, sequence_parallel={sp}")
        print(format_table(res[f"gpt sp={sp}"], ("layer", "phase", "collective", "calls",
                                                  "elements", "bytes_sent")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
