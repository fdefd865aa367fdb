"""Rank function for the layout tests: several layouts trained in one spawn of ranks.

Every layout builds its own process groups over the same world, trains the same global
batches as one process would, and reports what the tests compare: losses, this rank's
stage parameters unsharded (full GPT names), the bytes of parameters it holds, and, for
dropout checks, its local copies of tp-replicated parameters.
"""

from __future__ import annotations

import dataclasses

import torch

from shardwise.base.config import Config


def run_layout(cfg_dict: dict) -> dict:
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.engine import state as engine_state

    cfg = Config.from_dict(cfg_dict)
    trainer = build_trainer(cfg)
    topo = trainer.topology
    infos = [trainer.train_step() for _ in range(cfg.training.steps)]
    e = trainer.engine
    named = e.named_parameters()
    seen, param_bytes = set(), 0
    for _, q in named:
        st = q.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            param_bytes += st.nbytes()
    with e.full_parameters():
        params = {n: t.float() for n, t in engine_state.model_tensors(e).items()}
        replicated = {n: q.detach().clone() for n, q in named if getattr(q, "tp_dim", None) is None}
    return {"coords": topo.coords, "losses": list(trainer.history), "params": params,
            "skipped": [i.get("skipped", False) for i in infos],
            "loss_scale": [i.get("loss_scale") for i in infos],
            "replicated": replicated, "param_bytes": param_bytes,
            "memory": e.memory_bytes(), "gpt": dataclasses.asdict(trainer.model_cfg)}


def resume_layout(cfg_dict: dict, stop_at: int) -> dict:
    """Train ``stop_at`` steps and save; then a fresh trainer (new groups, new engine)
    resumes from the checkpoint and finishes the run. Losses and final parameters."""
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.engine import state as engine_state

    cfg = Config.from_dict(cfg_dict)
    first = build_trainer(cfg)
    for _ in range(stop_at):
        first.train_step()
    first.save_checkpoint()
    second = build_trainer(cfg)  # new groups, new engine
    second.resume()
    while second.step < cfg.training.steps:
        second.train_step()
    with second.engine.full_parameters():
        params = {n: t.float() for n, t in engine_state.model_tensors(second.engine).items()}
    return {"losses": list(second.history), "params": params, "resumed_at": stop_at}


def layouts_worker(configs: list[dict], resume: tuple[dict, int] | None = None) -> list[dict]:
    """Train every config in turn on this rank; one result per config (then the resume
    check, when given)."""
    torch.set_num_threads(1)
    out = [run_layout(c) for c in configs]
    if resume is not None:
        out.append(resume_layout(*resume))
    return out


def val_loss_worker(configs: list[dict]) -> list[float]:
    """The validation loss (``Trainer.evaluate``) of each config's freshly built model on this
    rank, in turn."""
    from shardwise.apps.lm.trainer import build_trainer

    torch.set_num_threads(1)
    return [build_trainer(Config.from_dict(c)).evaluate()["val_loss"] for c in configs]
