"""Rank function for the recomputation tests: several layouts trained in one spawn of ranks,
each without recomputation and with ``parallel.recompute = "selective"`` (or another
variant of its ``parallel`` section: ``"full"`` per block).

For every step a rank reports what the step returned (loss, gradient norm, a mixture's
auxiliary loss and expert load) and what it sent and received (``comm.accounting``: one
row per call: collective, algorithm, message size, payload bytes sent and received);
at the end its parameters, unsharded, and ``held``: the activations its forwards held
(``step_held``), the least over the steps after the first.

How ``held`` is measured, and why so: malloc's own count of the bytes it has handed out
(glibc's ``mallinfo2``, every thread and arena), when a backward begins, less the count when
the step began. Tensors are freed by whichever thread drops them last, often comm's
(``torch.profiler``'s memory events miss those, and moved by tens of KB from run to run
here); beforehand the rank drains comm's queue, waits for every rank at the same point
(pp = 1: no peer's backward can have sent anything yet) and collects cyclic garbage. The
spawning test turns glibc's per-thread caches off (``GLIBC_TUNABLES=glibc.malloc.
tcache_count=0``: a freed block it caches still counts as in use, up to ~240 KB a thread),
and the least over two steps drops a one-off growth of some process-wide table. So
measured, the same run gives the same bytes within ~1 KB on every rank.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc

import torch

from shardwise.base.config import Config


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]


def heap_bytes() -> int:
    """Bytes malloc has handed out and not taken back, every thread and arena (glibc's
    ``mallinfo2``: ``uordblks``, in use in the arenas, + ``hblkhd``, mmapped blocks)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd


def step_held(step, sync: bool) -> int:
    """Run ``step()``; the most bytes it had allocated and not freed when one of its
    backwards began: what the forwards before it keep (activations, and what selective
    recomputation keeps instead). ``sync``: wait for every rank there first (pp = 1 only,
    where every rank begins each backward at the same point)."""
    from shardwise.comm import barrier, drain

    drain()
    gc.collect()
    held, start = [], heap_bytes()
    real = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        drain()  # no transfer of ours in flight
        if sync:  # nor a peer's: none has begun its backward
            barrier()
        gc.collect()  # cycles the collector had not reached yet: not held
        held.append(heap_bytes() - start)
        return real(self, *args, **kwargs)

    torch.Tensor.backward = backward
    try:
        step()
    finally:
        torch.Tensor.backward = real
    return max(held)


def run(cfg_dict: dict, measure: bool = True) -> dict:
    """Train ``cfg_dict`` (``training.steps`` steps); losses, traffic per step, parameters
    and, with ``measure``, ``held`` (one process: ``measure=False``)."""
    from shardwise.apps.lm.trainer import build_trainer
    from shardwise.comm import accounting
    from shardwise.engine import state as engine_state

    trainer = build_trainer(Config.from_dict(cfg_dict))
    steps = trainer.cfg.training.steps
    traffic, held, infos = [], [], []
    for i in range(steps):
        with accounting.recording() as rec:
            if i > 0 and measure:  # the first step creates the optimizer's moments
                held.append(step_held(lambda: infos.append(trainer.train_step()),
                                      trainer.topology.pp == 1 and trainer.topology.world_size > 1))
            else:
                infos.append(trainer.train_step())
        traffic.append(sorted((r.collective, r.algorithm, r.nbytes, r.bytes_sent, r.bytes_recv)
                              for r in rec.records))
    e = trainer.engine
    with e.full_parameters():
        params = {n: t.detach().float().clone() for n, t in engine_state.model_tensors(e).items()}
    return {"coords": trainer.topology.coords, "losses": list(trainer.history),
            "model": dataclasses.asdict(trainer.model_cfg),
            "params": params, "traffic": traffic, "held": min(held, default=0),
            "checkpointed": list(e.checkpointed),
            "infos": [{k: v for k, v in i.items() if k != "lr"} for i in infos]}


def recompute_worker(configs: list[dict], variants: list[dict] | None = None) -> list[dict]:
    """Each config trained in turn on this rank, as it is and with its variant's ``parallel``
    fields (default: selective recomputation): ``[(plain, variant), ...]``."""
    torch.set_num_threads(1)
    out = []
    for i, c in enumerate(configs):
        variant = variants[i] if variants else {"recompute": "selective"}
        other = {**c, "parallel": {**c["parallel"], **variant}}
        out.append((run(c), run(other)))
    return out
