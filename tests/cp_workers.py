"""Rank functions for the context-parallel tests (run inside ``shardwise.launch.spawn``).

``cp_worker(jobs)`` runs each job in turn on every rank of the spawn, each with its own
process groups over the same world:

- ``kernel``: ``ring_kernel`` on rings of ``job["cp"]`` ranks (dp = world / cp rings side
  by side): for each case, every rank builds the same full q (B, H, T, D) and k, v (B, Hkv,
  T, D) from a seed, keeps its shard of the sequence, runs ``ring_attention`` forward and
  backward (with the same upstream gradient, sharded; a sliding window of ``case["window"]``
  tokens when set; the document ids of ``case_documents`` when ``case["docs"]`` is set),
  and reports its shard of the output
  and of the three gradients, for the test to stitch together and hold against full
  attention, and the bytes it sent and received and its calls, forward and backward;
- ``run`` / ``resume``: ``llama_workers.run_job`` (train a layout, report losses, whole
  parameters, bytes held); with ``measure_memory`` the executor's activation meter is on
  and its peak (bytes autograd saved for backward at once) is reported as ``activations``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.base.topology import Topology, init_process_groups


def ring_of(topology):
    from shardwise.parallel.context import Ring

    return Ring(topology.groups.cp, tuple(topology.axis_ranks("cp")), topology.cp_rank)


def full_inputs(case: dict):
    """q and dout (B, H, T, D), k and v (B, Hkv, T, D) with Hkv = ``case["kv_heads"]``
    (default H): seeded, in ``case["dtype"]`` (default fp32)."""
    g = torch.Generator().manual_seed(case["seed"])
    B, H, T, D = case["shape"]
    hkv = case.get("kv_heads", H)
    dtype = getattr(torch, case.get("dtype", "float32"))
    q, k, v, dout = (torch.randn(B, h, T, D, generator=g).to(dtype) for h in (H, hkv, hkv, H))
    return q, k, v, dout


def case_documents(case: dict) -> torch.Tensor | None:
    """(B, T) int64 document ids of a kernel case with ``case["docs"]`` (the share of
    tokens that are separators, each closing its document; seeded), else None."""
    if "docs" not in case:
        return None
    g = torch.Generator().manual_seed(1000 + case["seed"])
    B, _, T, _ = case["shape"]
    sep = (torch.rand(B, T, generator=g) < case["docs"]).long()
    return torch.cumsum(sep, dim=1) - sep


def ring_kernel(cases: list[dict], cp: int | None = None) -> list[dict]:
    from shardwise.comm import accounting
    from shardwise.parallel.context import ring_attention, shard_sequence

    ws = dist.get_world_size()
    cp = cp or ws
    topo = init_process_groups(Topology.build(dp=ws // cp, cp=cp, rank=dist.get_rank(),
                                              world_size=ws))
    ws = cp
    ring = ring_of(topo)
    out = []
    for case in cases:
        q, k, v, dout = full_inputs(case)
        # the causal layout is the load-balanced one; without a mask any cut is exact, so
        # the non-causal cases use the same one (the test stitches them back alike)
        mine = [shard_sequence(t, ws, topo.cp_rank, dim=2).clone().requires_grad_()
                for t in (q, k, v)]
        try:
            with accounting.recording() as rec:
                y = ring_attention(*mine, ring, causal=case["causal"], impl=case["impl"],
                                   window=case.get("window"), documents=case_documents(case))
        except ValueError as e:
            out.append({"error": str(e)})
            continue
        with accounting.recording() as back:
            y.backward(shard_sequence(dout, ws, topo.cp_rank, dim=2))
        out.append({"out": y.detach(), "dq": mine[0].grad, "dk": mine[1].grad,
                    "dv": mine[2].grad, "forward": _traffic(rec.records),
                    "backward": _traffic(back.records)})
    return out


def _traffic(records) -> tuple[int, int, int]:
    """(bytes sent, bytes received, calls) of one rank's records."""
    return (sum(r.bytes_sent or 0 for r in records), sum(r.bytes_recv or 0 for r in records),
            len(records))


def run_measured(job: dict) -> dict:
    """``llama_workers.run_job``: the same jobs and report, the executor's activation meter
    on when ``job["measure_memory"]`` (its peak reported as ``activations``)."""
    from llama_workers import run_job

    out = run_job(job)
    if job["cfg"]["training"].get("compile"):  # that compiling happened: graphs were made
        from torch._dynamo.utils import counters
        out["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
    return out


def cp_worker(jobs: list[dict]) -> list[dict]:
    torch.set_num_threads(1)
    return [ring_kernel(j["cases"], j["cp"]) if j["kind"] == "kernel" else run_measured(j)
            for j in jobs]
