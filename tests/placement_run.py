"""One rank of a big world, without the world: a layout's engine (or the app's trainer)
built and trained under ``placement.PlacementCheck`` and torch's fake process group.

``run_rank(sections, rank, world_size, device)`` builds the engine of one rank of a layout
(``sections``: config sections, as the parity suite's) under torch's fake process group
(``torch.testing._internal.distributed.fake_pg``: every collective and send/recv returns at
once and moves nothing, so one process stands for rank ``rank`` of ``world_size``) and runs
training steps, a validation loss and a short generation, all under the check. Values are
garbage (collectives move nothing); only placement is checked.

On meta ``comm``'s argument check runs too (its rounds read zeros: every rank agrees), so
its tensors are checked as well; on CUDA it is off (``fake_world``). Collectives run inline
(``comm``'s FIFO thread would run them outside the mode, which is per thread); with the fake
group nothing waits, so the order is unchanged.
"""

from __future__ import annotations

import contextlib
import sys
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from placement import PlacementCheck, PlacementError, Violation
from shardwise.base.config import Config

VOCAB = 65  # the characters of Shakespeare: not divisible by tp, so padding rows are built


# ------------------------------------------------------------------------- the fake world

class _InlineExecutor:
    """``comm``'s collectives run inline on the calling thread instead of on its FIFO
    thread: a dispatch mode is per thread, and under the fake group nothing ever waits, so
    the order is the same."""

    def __init__(self, real):
        self.real = real

    def submit(self, fn):
        from shardwise.comm.async_ import Handle

        fut: Future = Future()
        try:
            with torch.no_grad():
                fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 (delivered to wait(), as the thread does)
            fut.set_exception(exc)
        return Handle(fut)

    def run(self, fn):
        with torch.no_grad():
            return fn()

    def idle(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


@contextlib.contextmanager
def fake_world(rank: int, world_size: int, check_args: bool = False):
    """torch.distributed initialised as rank ``rank`` of ``world_size`` on the fake process
    group, ``comm``'s collectives inline, its argument check (``comm.check.agree``) on only
    with ``check_args``: it compares values that never arrive, which on meta read as zeros
    (every rank agrees) and on a real device as a disagreement. Restored on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardwise import comm
    from shardwise.comm import async_, primitives

    if dist.is_initialized():
        raise RuntimeError("fake_world: torch.distributed is already initialised")
    check = primitives.settings.check
    real = async_.executor
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    comm.configure(check=check_args)
    inline = _InlineExecutor(real)
    patched = [m for m in list(sys.modules.values())
               if m is not None and getattr(m, "__name__", "").startswith("shardwise.")
               and getattr(m, "executor", None) is real]
    for m in patched:
        m.executor = inline
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for m in patched:
            m.executor = real
        comm.configure(check=check)
        dist.destroy_process_group()


# ------------------------------------------------------------------------- one rank's run

def config(sections: dict) -> Config:
    """A tiny run in the layout of ``sections`` (merged over defaults)."""
    cfg = {
        "model": {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16},
        "parallel": {"dp": 1, "micro_batches": 1, "allreduce": "native"},
        "optimizer": {"lr": 3e-3, "warmup_steps": 1, "grad_clip": 1.0},
        "training": {"steps": 2, "global_batch_size": 8, "eval_every": 0, "sample_chars": 0,
                     "progress": False},
        "checkpoint": {"every": 0, "at_end": False},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return Config.from_dict(cfg)


@dataclass
class RankResult:
    coords: dict
    violations: list[Violation]
    structure: list[str]  # parameters / grads / masters / moments off device or dtype
    ops: int
    backward_ops: int
    seen: set[str]  # "namespace.op" of every op run
    losses: list


def run_rank(sections: dict, rank: int, world_size: int, device: torch.device,
             steps: int = 2, evaluate: bool = True, corpus: str | None = None) -> RankResult:
    """Rank ``rank`` of ``world_size`` of the layout ``sections``: engine built and
    ``steps`` training steps run under ``PlacementCheck`` on ``device`` (fake process
    group), then (``evaluate``) a validation loss and a two-token generation. With
    ``corpus`` (a text file) the language-model app's ``Trainer`` runs instead of the bare
    engine: its batches, its step, ``evaluate`` (the loss averaged over dp) and ``finish``'s
    sampling. Also checks, after the steps, where the state lives: every parameter and
    gradient on ``device`` in the compute dtype, every master piece and AdamW moment fp32,
    on ``device``, or on the host under ``training.offload``; ZeRO-3's compute-dtype
    parameter shards on ``device``, or on the host under ``"optimizer+params"``, its
    gradient shards on ``device``."""
    from shardwise.base.topology import Topology, init_process_groups
    from shardwise.parallel.precision import DTYPES

    cfg = config({**sections, "data": {"path": corpus}} if corpus else sections)
    p, t = cfg.parallel, cfg.training
    device = torch.device(device)
    dtype = DTYPES[t.precision]
    mode = PlacementCheck(device, {dtype, torch.float32, torch.float64})
    with fake_world(rank, world_size, check_args=device.type == "meta"):
        topo = init_process_groups(Topology.build(p.dp, p.pp, p.tp, cp=p.cp, rank=rank,
                                                  world_size=world_size, ep=p.ep))
        local = t.global_batch_size // p.dp  # the bare engine's batches (the trainer samples)
        g = torch.Generator().manual_seed(rank)
        batches = [torch.randint(0, VOCAB, (local, cfg.model.block_size + 1), generator=g)
                   for _ in range(steps)]
        try:
            with mode:
                if corpus:
                    engine, losses = _run_trainer(cfg, topo, device, steps, evaluate)
                else:
                    engine, losses = _run_engine(cfg, topo, device, batches, evaluate)
        except Exception as exc:  # a stray tensor made something fail: name where it was made
            if mode.violations:
                raise PlacementError(f"{type(exc).__name__} after a tensor left the device: "
                                     f"{mode.violations[0]}") from exc
            raise
        host = torch.device("cpu") if t.offload != "none" else device
        shards = torch.device("cpu") if t.offload == "optimizer+params" else device
        structure = _state_placement(engine, device, dtype, host, shards)
        return RankResult(topo.coords, mode.violations, structure, mode.ops,
                          mode.backward_ops, mode.seen, losses)


def _run_engine(cfg: Config, topo, device: torch.device, batches: list, evaluate: bool):
    from shardwise.engine import Engine, EngineConfig
    from shardwise.models import describe_section

    engine = Engine(describe_section(cfg.model, VOCAB), topo,  # eos 0: block_causal's
                    EngineConfig.of(cfg, eos_id=0), device)
    losses = []
    for b in batches:
        b = b.to(device)
        losses.append(engine.train_step(b[:, :-1], b[:, 1:], sync=False)["loss"])
    engine.drain()
    if evaluate:  # forward-only passes: the validation loss, two sampled tokens
        b = batches[0].to(device)
        engine.loss(b[:, :-1], b[:, 1:])
        gen = (None if device.type == "meta"  # meta has no generator
               else torch.Generator(device=device).manual_seed(0))
        engine.generate(b[:1, :4], 2, generator=gen)
    return engine, losses


def _run_trainer(cfg: Config, topo, device: torch.device, steps: int, evaluate: bool):
    from shardwise.apps.lm.trainer import Trainer

    trainer = Trainer(cfg, topo, device)
    losses = [trainer.train_step(sync=i == steps - 1)["loss"] for i in range(steps)]
    trainer.engine.drain()
    if evaluate:
        trainer.evaluate()
        if device.type != "meta":  # sampling draws from a generator on the device
            with trainer.engine.full_parameters():
                trainer._sample()
    return trainer.engine, losses


def _state_placement(engine, device: torch.device, dtype: torch.dtype,
                     host: torch.device, shards: torch.device) -> list[str]:
    """Where the state lives: parameters, gradients and gradient shards on ``device``,
    masters and moments on ``host`` and ZeRO-3's parameter shards on ``shards`` (each
    ``device`` itself unless offloaded)."""
    out = []

    def check(name, t, want, where=device):
        if t is None:
            return
        if t.device.type != where.type:
            out.append(f"{name}: on {t.device}, expected {where}")
        if want is not None and t.dtype != want:
            out.append(f"{name}: {t.dtype}, expected {want}")

    for n, q in engine.named_parameters():
        check(n, q, dtype)
        check(f"{n}.grad", q.grad, dtype)
    for i, t in enumerate(engine.sync.grad_shards()):
        check(f"gradient shard {i}", t, dtype)
    for i, t in enumerate(engine.sync.param_shards()):
        check(f"parameter shard {i}", t, dtype, shards)
    state = engine.optimizer.optimizer.state
    for i, m in enumerate(engine.sync.pieces):
        check(f"master piece {i}", m, torch.float32, host)
        for k in ("exp_avg", "exp_avg_sq"):
            check(f"master piece {i}.{k}", state.get(m, {}).get(k), torch.float32, host)
    return out
