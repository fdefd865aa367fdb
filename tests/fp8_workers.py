"""Rank function for fp8 under ZeRO (run inside ``shardwise.launch.spawn``; needs torchao),
and the tests' hook ``fp8_on_the_cpu``. The CPU has no float8 tensor cores: the device check
is lifted, and torch runs the float8 matmuls in software, which is enough to test how the
layers compose with the syncs (here, and under cp in ``test_ulysses.py``)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


@contextlib.contextmanager
def fp8_on_the_cpu():
    """The engine's fp8 device check lifted (the tests' hook; users keep the one-line
    refusal): torchao's float8 matmuls (``torch._scaled_mm``) then run on the CPU."""
    import shardwise.parallel.float8 as float8

    check, float8.check_fp8 = float8.check_fp8, lambda *a, **k: None
    try:
        yield
    finally:
        float8.check_fp8 = check


def train(zero: int, precision: str, steps: int = 4) -> dict:
    """``steps`` engine steps of a small Llama at dp = 2 with ``parallel.zero = zero``; the
    losses and how many layers were converted to float8."""
    from shardwise.base.topology import Topology, init_process_groups
    from shardwise.engine import Engine, EngineConfig
    from shardwise.models import LlamaConfig

    topo = init_process_groups(Topology.build(2, 1, 1, rank=dist.get_rank(), world_size=2))
    cfg = LlamaConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_kv_heads=2,
                      n_embd=64)
    with fp8_on_the_cpu():
        engine = Engine(cfg, topo, EngineConfig(
            seq_len=32, parallel={"zero": zero}, optimizer={"lr": 1e-2, "grad_clip": 0.0},
            training={"precision": precision, "global_batch_size": 8}))
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 128, (8, 33), generator=g)
        mine = x.chunk(2)[topo.dp_rank]  # this replica's half of the global batch
        losses.append(engine.train_step(mine[:, :-1], mine[:, 1:])["loss"])
    return {"losses": losses, "fp8_layers": len(engine.fp8_layers)}
