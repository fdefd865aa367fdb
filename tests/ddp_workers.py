"""Rank functions for the data-parallel tests (run inside ``shardwise.launch.spawn``)."""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from shardwise.base.config import Config


def tiny_config(corpus: str, out_dir: str, **sections) -> dict:
    """A 2-layer GPT config on ``corpus`` (sections update it). Under
    ``SHARDWISE_TEST_DEVICE=cuda`` (tests/conftest.py) it trains on the GPU, every rank on
    it, over gloo, TF32 off."""
    cfg = {
        "model": {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 32},
        "data": {"path": corpus},
        "parallel": {"dp": 1, "micro_batches": 1},
        "optimizer": {"lr": 3e-3, "warmup_steps": 2},
        "training": {"steps": 5, "global_batch_size": 16, "eval_every": 0, "log_every": 1,
                     "out_dir": out_dir, "sample_chars": 0, "progress": False},
        "checkpoint": {"every": 0, "at_end": False},
    }
    if os.environ.get("SHARDWISE_TEST_DEVICE") == "cuda":
        cfg["training"].update(device="cuda", tf32=False)
        cfg["parallel"]["backend"] = "gloo"
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return Config.from_dict(cfg).model_dump()


def _trainer(cfg_dict: dict):
    from shardwise.apps.lm.trainer import build_trainer

    return build_trainer(Config.from_dict(cfg_dict))


def _result(trainer) -> dict:
    """Losses, and this rank's stages' parameters unsharded (full GPT names; gathered over
    tp, and over dp under ZeRO-3), plus what each test inspects of the gradient sync."""
    from shardwise.engine import state as engine_state

    e = trainer.engine
    out = {"losses": list(trainer.history)}
    params = [p for _, p in e.named_parameters()]
    out["materialised_elements"] = sum(
        p.untyped_storage().nbytes() // p.element_size()
        for p in params if p.untyped_storage().nbytes() > 0
        and p.data_ptr() == p.untyped_storage().data_ptr())
    out["memory"], out["coords"] = e.memory_bytes(), trainer.topology.coords  # between steps
    out["gpt"] = dataclasses.asdict(trainer.model_cfg)
    with e.full_parameters():  # ZeRO-3: gather (collectively) to compare full weights
        out["params"] = engine_state.model_tensors(e)
    out["stage_params"] = out["params"]
    sync = getattr(e.sync, "sync", None)
    if sync is not None:
        out["n_buckets"] = len(sync.buckets)
    out["optimizer_elements"] = sum(m.numel() for m in e.sync.pieces)
    out["parameter_elements"] = sum(p.numel() for p in params)
    out["full_grads_after_backward"] = sum(p.grad.numel() for p in params if p.grad is not None)
    return out


def train(cfg_dict: dict) -> dict:
    """Train ``training.steps`` steps; return losses and parameters of this rank."""
    trainer = _trainer(cfg_dict)
    for _ in range(trainer.cfg.training.steps):
        trainer.train_step()
    return _result(trainer)


def train_each(cfg_dicts: list[dict]) -> list[dict]:
    """``train`` for each config in turn, in one process group (one spawn, several layouts),
    the last step under ``comm.accounting``: ``"collectives"`` lists its calls as
    (collective, bytes of the call's message)."""
    from shardwise.comm import accounting

    out = []
    for c in cfg_dicts:
        trainer = _trainer(c)
        for i in range(trainer.cfg.training.steps):
            if i == trainer.cfg.training.steps - 1:
                with accounting.recording() as rec:
                    trainer.train_step()
            else:
                trainer.train_step()
        calls = [(r.collective, r.nbytes) for r in rec.records]
        out.append(_result(trainer) | {"collectives": calls})
    return out


def train_and_checkpoint(cfg_dict: dict, stop_at: int) -> dict:
    """Train ``stop_at`` steps of a ``training.steps``-long run, save, and stop."""
    trainer = _trainer(cfg_dict)
    for _ in range(stop_at):
        trainer.train_step()
    trainer.save_checkpoint()
    return _result(trainer)


def train_saving_at(cfg_dict: dict, at: int) -> dict:
    """The whole run, saving a checkpoint after step ``at`` on the way (as ``checkpoint.every``
    does; PipeDream drains its stream there)."""
    trainer = _trainer(cfg_dict)
    while trainer.step < trainer.cfg.training.steps:
        trainer.train_step()
        if trainer.step == at:
            trainer.save_checkpoint()
    return _result(trainer)


def resume_and_finish(cfg_dict: dict) -> dict:
    trainer = _trainer(cfg_dict)
    trainer.resume()
    start = trainer.step
    while trainer.step < trainer.cfg.training.steps:
        trainer.train_step()
    return _result(trainer) | {"resumed_at": start}


def run_all(calls: list[tuple]) -> list:
    """``[fn(*args) for fn, args in calls]`` on this rank: several runs (each building its
    own process groups over the same world) in one spawn of ranks, as the layout tests do;
    each spawn costs seconds of start-up. ``fn``: a module-level function (pickled by name)."""
    return [fn(*args) for fn, args in calls]


def straight_and_resumed(runs: dict, stop_at: int = 4) -> dict:
    """Resume tests in two spawns of 2 ranks: ``runs`` maps a case to ``(straight, cut)``,
    ``straight`` the uninterrupted run as a ``(fn, args)`` call and ``cut`` the config cut
    at step ``stop_at`` (``train_and_checkpoint``), then resumed in fresh processes
    (``resume_and_finish``). Returns case -> (straight results, resumed results), one per
    rank."""
    from shardwise.launch import spawn

    calls, resume_calls = [], []
    for straight, cut in runs.values():
        calls += [straight, (train_and_checkpoint, (cut, stop_at))]
        resume_calls.append((resume_and_finish, (cut,)))
    first = spawn(run_all, 2, (calls,))
    resumed = spawn(run_all, 2, (resume_calls,))
    return {case: ([r[2 * i] for r in first], [r[i] for r in resumed])
            for i, case in enumerate(runs)}


def overlap_probe(bucket_mb: float) -> dict:
    """Different init per rank, our DDP, one backward: report broadcast and overlap facts."""
    from shardwise.models import GPT, GPTConfig
    from shardwise.parallel.data_parallel import DistributedDataParallel

    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # deliberately different: the broadcast must fix it
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=64))
    ddp = DistributedDataParallel(model, None, bucket_mb=bucket_mb)
    after_broadcast = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    x = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(rank))
    _, loss = ddp(x, x)
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return {"params": after_broadcast, "grads": grads, "timing": ddp.last_timing,
            "n_buckets": len(ddp.buckets)}


def train_infos(cfg_dict: dict) -> dict:
    """Train and return every step's info (loss, grad_norm, loss_scale, skipped)."""
    trainer = _trainer(cfg_dict)
    infos = [trainer.train_step() for _ in range(trainer.cfg.training.steps)]
    return {"infos": infos, "losses": list(trainer.history)}


def memory_after_steps(cfg_dict: dict) -> dict:
    """Train, then report predicted and measured bytes of this rank (zero.memory)."""
    from shardwise.parallel.zero.memory import report

    trainer = _trainer(cfg_dict)
    for _ in range(trainer.cfg.training.steps):
        trainer.train_step()
    e = trainer.engine
    model = torch.nn.ModuleList(e.local.chunks.values())
    (wrapper,) = getattr(e.sync, "parts", (e.sync,))  # ZeRO-3: one ZeroStage3 per chunk (one here)
    return report(model, wrapper, e.optimizer.optimizer, trainer.cfg.parallel.zero)
