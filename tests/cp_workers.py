"""Rank functions for the context-parallel tests (run inside ``shardwise.launch.spawn``).

``ring_kernel(cases)``: for each case, every rank builds the same full q, k, v (B, H, T, D)
from a seed, keeps its shard of the sequence, runs ``ring_attention`` forward and backward
(with the same upstream gradient, sharded), and reports its shard of the output and of the
three gradients, for the test to stitch together and hold against full attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.base.topology import Topology, init_process_groups


def ring_of(topology):
    from shardwise.parallel.context import Ring

    return Ring(topology.groups.cp, tuple(topology.axis_ranks("cp")), topology.cp_rank)


def full_inputs(case: dict):
    g = torch.Generator().manual_seed(case["seed"])
    B, H, T, D = case["shape"]
    dtype = getattr(torch, case.get("dtype", "float32"))
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(4))
    return q, k, v, dout


def ring_kernel(cases: list[dict]) -> list[dict]:
    from shardwise.parallel.context import ring_attention, shard_sequence

    torch.set_num_threads(1)
    ws = dist.get_world_size()
    topo = init_process_groups(Topology.build(cp=ws, rank=dist.get_rank(), world_size=ws))
    ring = ring_of(topo)
    out = []
    for case in cases:
        q, k, v, dout = full_inputs(case)
        # the causal layout is the load-balanced one; without a mask any cut is exact, so
        # the non-causal cases use the same one (the test stitches them back alike)
        mine = [shard_sequence(t, ws, topo.cp_rank, dim=2).clone().requires_grad_()
                for t in (q, k, v)]
        try:
            y = ring_attention(*mine, ring, causal=case["causal"], impl=case["impl"])
        except ValueError as e:
            out.append({"error": str(e)})
            continue
        y.backward(shard_sequence(dout, ws, topo.cp_rank, dim=2))
        out.append({"out": y.detach(), "dq": mine[0].grad, "dk": mine[1].grad,
                    "dv": mine[2].grad})
    return out
