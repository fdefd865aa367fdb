"""Rank function for the mixture-of-experts tests: several MoE Llama jobs in one spawn.

``moe_worker(jobs)`` runs each job in turn on every rank of the spawn (each with its own
process groups over the same world); ``run_job(job)`` is one job, in the test's own process
for one rank (the single-process reference). A job trains ``training.steps`` steps (saving
after step ``save_at`` when given), or (``resume``) loads ``path`` first; it reports the
losses, each step's router statistics (``aux_loss``, ``expert_load``, ``dropped``: the
assignments over capacity) and gradient norm, this rank's stage parameters unsharded
(gathered over tp and ep: full model names and shapes), its routing biases (``biases``:
``expert_bias`` of each mixture, with a bias update rate), the local shapes of its expert
weights, the bytes it holds, and with ``record`` the all-to-all calls of one
more step (``comm.accounting``).
"""

from __future__ import annotations

import torch

from llama_workers import report, train


def run_job(job: dict) -> dict:
    """``llama_workers.train`` (a ``resume`` job may name ``from_dir`` instead of ``path``)
    and ``llama_workers.report``, with the router statistics and the gradient norm (before
    clipping) of each step (``stats``),
    ``coords`` with the rank's ``ep`` coordinate, ``local_shapes`` of the expert weights
    only, and with ``job["record"]`` the all-to-all calls of one more step (``a2a``: after
    the report, which stays that of ``training.steps`` steps)."""
    from shardwise.comm import accounting

    trainer, out, infos = train(job)
    stats = [{"aux_loss": i["aux_loss"], "expert_load": i["expert_load"],
              "dropped": float(i.get("expert_dropped", 0)),
              "grad_norm": i["grad_norm"]} for i in infos]
    rep = report(trainer)
    rep["coords"] = {**rep["coords"], "ep": trainer.topology.ep_rank}
    rep["local_shapes"] = {n: s for n, s in rep["local_shapes"].items() if ".experts." in n}
    rep["biases"] = {n: b.detach().cpu().clone()  # routing biases of this rank's stage
                     for n, b in trainer.engine.local.named_buffers()}
    if job.get("record"):
        with accounting.recording() as rec:
            trainer.train_step()
        out["a2a"] = [r for r in accounting.table(rec.records) if r["collective"] == "all_to_all"]
    return {**rep, "stats": stats, **out}


def moe_worker(jobs: list[dict]) -> list[dict]:
    torch.set_num_threads(1)
    return [run_job(j) for j in jobs]
