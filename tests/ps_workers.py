"""Rank functions and the one-process reference for the parameter-server tests."""

from __future__ import annotations

import torch

from shardwise.base.config import Config


def ps_config(corpus: str, out_dir: str, servers: int, workers: int, consistency: str = "bsp",
              staleness: int | None = None, optimizer: str = "adamw", steps: int = 5,
              slow_worker: str | None = None, worker_timeout_s: float = 60.0,
              checkpoint_every: int = 0, checkpoint_dir: str | None = None) -> dict:
    cfg = {
        "model": {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 32},
        "data": {"path": corpus},
        "parallel": {"mode": "ps"},
        "ps": {"servers": servers, "workers": workers, "consistency": consistency,
               "staleness": staleness, "optimizer": optimizer, "slow_worker": slow_worker,
               "worker_timeout_s": worker_timeout_s},
        "optimizer": {"lr": 3e-3, "warmup_steps": 2, "grad_clip": 0.0},
        "training": {"steps": steps, "global_batch_size": 24, "eval_every": 0, "log_every": 1,
                     "out_dir": out_dir, "sample_chars": 0, "progress": False, "eval_batches": 1},
        "checkpoint": {"every": checkpoint_every, "at_end": checkpoint_dir is not None,
                       "dir": checkpoint_dir, "keep": 5},
    }
    return Config.from_dict(cfg).model_dump()


def reference(cfg_dict: dict) -> dict:
    """One process on the whole global batch of every step, torch's optimizer on the whole
    model: what BSP must equal."""
    from shardwise.apps.param_server.optim import lr_at, make_optimizer
    from shardwise.apps.param_server.training import _data_and_model
    from shardwise.data import DistributedBatchSampler

    cfg = Config.from_dict(cfg_dict)
    train_tokens, _, model = _data_and_model(cfg, torch.device("cpu"))
    params = list(model.parameters())
    opt = make_optimizer(cfg.ps.optimizer, params, cfg.optimizer, cfg.ps.momentum)
    t = cfg.training
    sampler = DistributedBatchSampler(train_tokens, cfg.model.block_size, t.global_batch_size,
                                      0, 1, seed=t.seed)
    losses = []
    for step in range(t.steps):
        x, y = sampler.next_batch()
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.optimizer, t.steps)
        opt.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def run_cases(cfg_dicts: list[dict], resume: bool = False) -> list[dict]:
    """Several parameter-server jobs one after another on the same ranks (one spawn)."""
    from shardwise import comm
    from shardwise.apps.param_server import train_rank

    out = []
    for cfg in cfg_dicts:
        res = train_rank(cfg, resume=resume)
        res.pop("times", None)
        out.append(res)
        comm.barrier()
    return out


def faulty(cfg_dict: dict, stop: dict, join: dict, pause: dict | None = None) -> dict:
    """One job where worker ``w`` falls silent after ``stop[w]`` clocks (as if killed) and
    worker ``v`` joins once ``join[v]`` updates are applied. No barrier after: a stopped
    rank is gone."""
    import torch.distributed as dist

    from shardwise import comm
    from shardwise.apps.param_server.training import run_server, run_worker

    cfg = Config.from_dict(cfg_dict)
    comm.configure(timeout_s=cfg.parallel.timeout_s)
    rank, S = dist.get_rank(), cfg.ps.servers
    cpu = torch.device("cpu")
    if rank < S:
        return run_server(cfg, rank, cpu)
    w = rank - S
    res = run_worker(cfg, w, cpu, stop_after=stop.get(w), join_after=join.get(w, 0),
                     pauses=(pause or {}).get(w))
    res.pop("params", None)
    return res


def run_plan(plan: list[tuple]) -> list[dict]:
    """Jobs one after another on the same ranks: ``("train", cfg, resume)``, ``("paused",
    cfg, pauses)`` and ``("late", cfg, late, pauses)`` entries (a barrier after each), then optionally one ``("faulty", cfg, stop, join)`` last (it ends
    with a rank gone, so nothing may follow it)."""
    from shardwise import comm
    from shardwise.apps.param_server import train_rank

    out = []
    for kind, cfg, *args in plan:
        if kind == "late":  # nobody leaves: a barrier may follow
            out.append(late_push(cfg, *args))
            comm.barrier()
            continue
        if kind == "paused":  # nobody leaves: a barrier may follow
            out.append(faulty(cfg, {}, {}, args[0]))
            comm.barrier()
            continue
        if kind == "faulty":
            out.append(faulty(cfg, *args))
            break
        res = train_rank(cfg, resume=args[0])
        res.pop("times", None)
        out.append(res)
        comm.barrier()
    return out


def late_push(cfg_dict: dict, late: dict[int, dict[int, float]],
              pause: dict[int, dict[int, float]] | None = None) -> dict:
    """One job where worker ``w`` sleeps ``late[w][clock]`` seconds between pushing its
    gradient of ``clock`` to server 0 and to the other servers: a server can then reach a
    collective checkpoint while the other still waits for that push."""
    import time

    import torch.distributed as dist

    from shardwise import comm
    from shardwise.apps.param_server import protocol as P
    from shardwise.apps.param_server.training import run_server, run_worker
    from shardwise.apps.param_server.worker import Worker

    cfg = Config.from_dict(cfg_dict)
    comm.configure(timeout_s=cfg.parallel.timeout_s)
    rank, S = dist.get_rank(), cfg.ps.servers
    cpu = torch.device("cpu")
    if rank < S:
        return run_server(cfg, rank, cpu, group=dist.new_group(list(range(S))))
    dist.new_group(list(range(S)))  # every rank makes every group
    w, pushed = rank - S, []

    def push(self, clock: int) -> None:
        for i, dst in enumerate(self.server_ranks):
            if i == 1 and clock in late.get(w, {}):
                time.sleep(late[w][clock])
            P.send_header(dst, P.TAG_REQUEST, P.PUSH, self.index, clock, 0, self.device)
            comm.send(self._slice(self.grad, i), dst, tag=P.TAG_REQUEST)
        pushed.append(clock)

    plain, Worker.push = Worker.push, push
    try:
        res = run_worker(cfg, w, cpu, pauses=(pause or {}).get(w))
    finally:  # the jobs after this one push as usual
        Worker.push = plain
    res.pop("params", None)
    return res | {"pushed": pushed}
