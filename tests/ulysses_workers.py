"""Rank functions for the all-to-all context-parallel tests (``test_ulysses.py``), run inside
``shardwise.launch.spawn``.

``ulysses_worker(jobs)`` runs each job in turn on every rank, each with its own process
groups over the same world:

- ``kernel``: on head groups of ``job["a2a"]`` of ``job["cp"]`` cp ranks (dp = world / cp
  side by side; the ring takes cp / a2a), for each case every rank builds the same full
  q, k, v and upstream gradient (``cp_workers.full_inputs``), keeps its shard of the
  sequence (the load-balanced layout), runs the engine's context-parallel attention
  (``ContextParallel`` of ``engine.parallelize.apply_cp``, the ``pairwise`` all-to-all: its
  bytes are counted) forward and backward, and reports its shard of the output and of the
  three gradients, and per collective the bytes it sent, forward and backward;
- ``count``: train one step of ``job["cfg"]``, then count the all-to-all calls of a second
  (``comm.accounting``; a replayed one makes no record);
- ``run`` / ``resume``: ``cp_workers.run_measured`` (train a layout, report losses and
  whole parameters);
- ``fp8``: ``run_fp8`` (the same, ``training.precision = "fp8"`` on the CPU).
"""

from __future__ import annotations

import dataclasses
import types

import torch
import torch.distributed as dist

from shardwise.base.topology import Topology, init_process_groups


def ulysses_kernel(cases: list[dict], cp: int, a2a: int) -> list[dict]:
    from cp_workers import case_documents, full_inputs

    from shardwise.comm import accounting
    from shardwise.engine.parallelize import apply_cp
    from shardwise.models import sequence
    from shardwise.models.gpt import causal_attention
    from shardwise.parallel.context import shard_sequence

    ws = dist.get_world_size()
    topo = init_process_groups(Topology.build(dp=ws // cp, cp=cp, rank=dist.get_rank(),
                                              world_size=ws))
    T = cases[0]["shape"][2]
    desc = types.SimpleNamespace(kind="test", context_parallel=True,  # what apply_cp reads
                                 ring_attention=True)
    ctx = apply_cp(desc, topo, T, torch.device("cpu"), True, a2a, "pairwise")
    out = []
    for case in cases:
        q, k, v, dout = full_inputs(case)
        mine = [shard_sequence(t, cp, topo.cp_rank, dim=2).clone().requires_grad_()
                for t in (q, k, v)]
        ctx.shard(torch.zeros(1, T))
        docs = case_documents(case)
        shard = ctx.current if docs is None else dataclasses.replace(ctx.current,
                                                                     documents=docs)
        try:
            with accounting.recording() as rec, sequence.use(shard):
                y = causal_attention(*mine, impl=case["impl"], window=case.get("window"),
                                     softcap=case.get("softcap"))
        except ValueError as e:
            out.append({"error": str(e)})
            continue
        with accounting.recording() as back:
            y.backward(shard_sequence(dout, cp, topo.cp_rank, dim=2))
        out.append({"out": y.detach(), "dq": mine[0].grad, "dk": mine[1].grad,
                    "dv": mine[2].grad, "forward": _traffic(rec.records),
                    "backward": _traffic(back.records)})
    return out


def _traffic(records) -> list[tuple[str, int]]:
    """(collective, bytes sent) of each of one rank's records, in order."""
    return [(r.collective, r.bytes_sent or 0) for r in records]


def count_calls(cfg: dict) -> int:
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.base.config import Config
    from shardwise.comm import accounting

    trainer = build_trainer(Config.from_dict(cfg))
    trainer.train_step()
    with accounting.recording() as rec:
        trainer.train_step()
    return sum(r.collective == "all_to_all" for r in rec.records)


def run_fp8(job: dict) -> dict:
    """``llama_workers.run_job`` under ``fp8_workers.fp8_on_the_cpu``, plus how many Linear
    layers were converted (``fp8_layers``)."""
    from fp8_workers import fp8_on_the_cpu
    from llama_workers import report, train

    with fp8_on_the_cpu():
        trainer, out, _ = train(job)
    return {**report(trainer), **out, "fp8_layers": len(trainer.engine.fp8_layers)}


def ulysses_worker(jobs: list[dict]) -> list:
    from cp_workers import run_measured

    torch.set_num_threads(1)
    kinds = {"kernel": lambda j: ulysses_kernel(j["cases"], j["cp"], j["a2a"]),
             "count": lambda j: count_calls(j["cfg"]), "fp8": run_fp8}
    return [kinds.get(j["kind"], run_measured)(j) for j in jobs]
