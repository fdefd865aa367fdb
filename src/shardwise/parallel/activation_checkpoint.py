"""Activation recomputation per layer: selective (``parallel.recompute = "selective"``) and
full (``parallel.recompute = "full"``).

Each layer's forward runs under ``torch.utils.checkpoint`` (non-reentrant) with torch's
selective-checkpoint contexts (``create_selective_checkpoint_contexts``): the outputs of the
matrix products and of fused attention are saved for backward; everything else the layer
computes (norms, RoPE, activation functions, residual adds, their casts) is recomputed in
backward from the layer's input. Sources: torchtitan's op-level selective activation
checkpointing (``activation_checkpoint.mode = "selective"``, ``selective_ac_option = "op"``)
and Korthikanti et al. 2022 (arXiv:2205.05198), whose selective recomputation keeps the
matmuls' outputs and recomputes the memory-hungry, FLOP-cheap parts. Numerics are unchanged:
recomputed ops are deterministic functions of saved values (dropout's random state is
replayed by checkpoint). Full recomputation (``checkpoint_whole``) is the same wrapper
without the policy: a block keeps only its input and recomputes everything in backward
(torchtitan's ``activation_checkpoint.mode = "full"``; Chen et al. 2016, arXiv:1604.06174).
Stage-level recomputation (``recompute = "stage"``) is the pipeline executor's: a stage
keeps only its input. What the recomputed forward does besides computing
happens once (collectives replayed by ``comm.replay``, ZeRO-3's gathers outside the region,
the forward's ``contextvars`` and dropout stream, routing statistics counted once): see
docs/architecture.md, "Selective recomputation in one paragraph".
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
                "use parallel.recompute = \"stage\"")

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
    context_fn = functools.partial(create_selective_checkpoint_contexts, _policy)
    return _checkpointed(layer, rng, name, {"context_fn": context_fn})


def checkpoint_whole(layer: nn.Module, rng=None, name: str = "") -> nn.Module:
    """Make ``layer``'s forward recomputed whole in backward: only its input (and the outputs
    of its collectives, replayed) kept (in place; returns it). Arguments and hooks as
    ``checkpoint_selectively``'s."""
    return _checkpointed(layer, rng, name, {})


def _checkpointed(layer: nn.Module, rng, name: str, options: dict) -> nn.Module:
    """``layer.forward`` replaced by a non-reentrant checkpoint of it (``options``: the
    checkpoint's ``context_fn``, if any) recording its collectives and replaying them."""
    inner = layer.forward

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

        return checkpoint(run, *args, use_reentrant=False, **options, **kwargs)

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


def offload_saved(layer: nn.Module, device: torch.device) -> nn.Module:
    """Make the tensors ``layer``'s forward saves for backward wait in host memory (pinned
    on CUDA) until its backward brings them back (``torch.autograd.graph.save_on_cpu``;
    Megatron's activation offloading), in place; returns it. On the CPU the two coincide
    and nothing is copied. A block also checkpointed keeps its saved tensors in the
    checkpoint's hooks (the innermost), so offload changes nothing there."""
    inner = layer.forward
    pin = device.type == "cuda"

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        with torch.autograd.graph.save_on_cpu(pin_memory=pin, device_type=device.type):
            return inner(*args, **kwargs)

    layer.forward = forward
    return layer
