"""Selective activation recomputation (``parallel.recompute = "selective"``).

Each layer's forward runs under ``torch.utils.checkpoint`` (non-reentrant) with torch's
selective-checkpoint contexts (``create_selective_checkpoint_contexts``): the outputs of the
matrix products and of fused attention are saved for backward, as without recomputation;
everything else the layer computes (norms, RoPE, activation functions, residual adds, their
casts) is recomputed in backward from the layer's input. That is torchtitan's op-level
selective activation checkpointing (its ``activation_checkpoint.mode = "selective"``,
``selective_ac_option = "op"``, which also saves every matmul but some), and close to
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198), whose selective recomputation keeps the matmuls' outputs and recomputes
the memory-hungry, FLOP-cheap parts. Numerics are unchanged: recomputed ops are
deterministic functions of saved values (dropout's random state is replayed by checkpoint).

Full recomputation (``recompute = true``) is the pipeline executor's: a stage keeps only its
input. Selective recomputation runs a layer's Python forward again in backward, so what that
forward does besides computing is made to happen once:

- collectives (tensor parallelism's g all-reduce, sequence parallelism's all-gather and
  reduce-scatter, the experts' token counts and all-to-alls, the mixture's per-sequence
  counts over cp): recorded in forward and replayed in the recomputation without
  communicating (``comm.replay``; Korthikanti et al. sec. 5 and torchtitan keep such outputs
  too). What this keeps per layer and micro-batch, for b sequences of s tokens of width h
  and element size e: under tp without SP the attention's and the MLP's all-reduced outputs,
  2 b s h e; under SP the two reduce-scattered outputs, 2 b (s / tp) h e, and the two
  all-gathered inputs, 2 b s h e; with experts the dispatched and combined rows (k b s h e
  each at ep > 1) and the counts. The ring attention's key/value shifts (cp > 1) run again
  instead (``parallel.context.ring_comm``: every rank recomputes in one order);
- ZeRO-3's gathers are module hooks around ``forward``, outside the recomputed region: a
  unit is gathered again for its backward (as without recomputation), and its
  recomputation reads those gathered parameters;
- ``contextvars`` (the context-parallel shard of ``models.sequence``, set around the
  chunk's forward, not around backward) and the tensor-parallel dropout stream
  (``tensor_parallel.random.ParallelRNG``) are those the forward saw; the default
  generator is restored by ``torch.utils.checkpoint`` itself;
- the mixture of experts' routing statistics are counted in forward only
  (``comm.replay.recomputing``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from shardwise.comm import replay

# Not yet on CUDA: on an H100 the engine's selective row trained to another loss than the
# plain run (docs/gpu.md); refused at the door (cli) and in the engine until the gpu-marked
# tests/test_recompute.py check has run there.
CUDA_REFUSAL = ("parallel.recompute=selective on CUDA: not verified there yet (on an H100 its "
                "loss after 7 steps left the plain run's, 8.03 against 9.19: docs/gpu.md); "
                "use parallel.recompute = true")

_aten = torch.ops.aten
# the ops whose outputs are saved: what costs FLOPs to recompute
SAVED_OPS = frozenset(op for op in (
    getattr(_aten, "mm", None), getattr(_aten, "addmm", None), getattr(_aten, "bmm", None),
    getattr(_aten, "_scaled_mm", None),
    getattr(_aten, "_scaled_dot_product_flash_attention", None),
    getattr(_aten, "_scaled_dot_product_efficient_attention", None),
    getattr(_aten, "_scaled_dot_product_cudnn_attention", None),
    getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None),
) if op is not None)


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    base = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if base in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_selectively(layer: nn.Module, rng=None, name: str = "") -> nn.Module:
    """Make ``layer``'s forward selectively recomputed in backward (in place; returns it).

    Its forward hooks and ``layer.compile()`` still apply: the wrapper replaces the
    instance's ``forward`` only, so hooks (ZeRO-3's gathers, context parallelism's shard)
    run once, outside the recomputed region. ``rng``: the layer's tensor-parallel dropout
    stream (a ``ParallelRNG``; None without tp), rewound for the recomputation. ``name``
    names the layer in a ``comm.replay.ReplayError`` (raised in backward when the
    recomputation calls other collectives than its forward did)."""
    inner = layer.forward
    context_fn = functools.partial(create_selective_checkpoint_contexts, _policy)

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        log = replay.CollectiveLog(name or type(layer).__name__)
        seen: dict = {}

        def run(*a, **k):
            if not seen:  # forward: record, and note what the recomputation must see again
                seen["vars"] = contextvars.copy_context()
                seen["rng"] = None if rng is None else rng.state
                with log.recording():
                    return inner(*a, **k)
            return seen["vars"].run(again, *a, **k)

        def again(*a, **k):
            with log.replaying(), _rewound(rng, seen["rng"]):
                return inner(*a, **k)

        return checkpoint(run, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    layer.forward = forward
    return layer


@contextlib.contextmanager
def _rewound(rng, state):
    """``rng`` (a ``ParallelRNG``) drawing from ``state`` within the block, then from where
    it was."""
    if rng is None:
        yield
        return
    live, rng.state = rng.state, state
    try:
        yield
    finally:
        rng.state = live
