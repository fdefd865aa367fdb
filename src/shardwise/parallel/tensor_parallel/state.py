"""Gradients and state of a tensor-parallel model: norms, replica sync, full state dicts.

A parameter with a ``tp_dim`` attribute is sharded along that dim (each tp rank holds a
different slice); every other parameter is replicated on the tp ranks. Vocabulary-split
parameters (token embedding, LM head) are padded to a multiple of tp with rows that the
full state dict drops again. The full state dict uses the unsharded GPT's names and
shapes, so a checkpoint taken at one tp loads at any other.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from shardwise import comm
from shardwise.comm.coalesce import coalesced_
from shardwise.parallel.precision import global_norm
from shardwise.parallel.tensor_parallel.group import RankGroup
from shardwise.parallel.tensor_parallel.layers import gather_tensor, shard_tensor

VOCAB_PARAMS = ("embed.tok.weight", "head.proj.weight")


def is_sharded(p: torch.Tensor) -> bool:
    """True for a parameter split over the tensor-parallel ranks (it carries ``tp_dim``)."""
    return getattr(p, "tp_dim", None) is not None


def _vocab_rows(model: nn.Module, name: str) -> int | None:
    cfg = getattr(model, "cfg", None)
    return cfg.vocab_size if cfg is not None and name in VOCAB_PARAMS else None


@torch.no_grad()
def gather_like(p: torch.Tensor, local: torch.Tensor, tp: RankGroup,
                vocab_rows: int | None = None) -> torch.Tensor:
    """The full tensor of ``local``, a tensor shaped like parameter ``p`` (the parameter, a
    gradient, Adam's moments): gathered over tp along ``p.tp_dim`` when ``p`` is sharded,
    trimmed to ``vocab_rows`` rows for a vocabulary-padded parameter. Collective over tp
    when sharded."""
    if not is_sharded(p) or tp.size == 1:
        return local.detach().clone()
    full = gather_tensor(local, p.tp_dim, tp)
    return full if vocab_rows is None else full[:vocab_rows].clone()


@torch.no_grad()
def shard_like(p: torch.Tensor, full: torch.Tensor, tp: RankGroup,
               vocab_rows: int | None = None) -> torch.Tensor:
    """Inverse of ``gather_like``: this rank's slice of ``full`` (vocabulary padding added
    back when ``vocab_rows`` is given)."""
    if not is_sharded(p) or tp.size == 1:
        return full.detach().clone()
    if vocab_rows is not None and p.shape[0] * tp.size > full.shape[0]:
        pad = full.new_zeros((p.shape[0] * tp.size - full.shape[0],) + tuple(full.shape[1:]))
        full = torch.cat([full, pad])
    return shard_tensor(full, p.tp_dim, tp)


def gather_param(model: nn.Module, name: str, local: torch.Tensor, tp: RankGroup) -> torch.Tensor:
    """The full (unsharded, unpadded) tensor of parameter ``name`` from this rank's
    ``local`` (the parameter, or any tensor shaped like it: a gradient, Adam's moments).
    Collective over the tp group when the parameter is sharded."""
    return gather_like(model.get_parameter(name), local, tp, _vocab_rows(model, name))


def shard_param(model: nn.Module, name: str, full: torch.Tensor, tp: RankGroup) -> torch.Tensor:
    """This rank's slice of the full tensor of parameter ``name`` (padding added back)."""
    return shard_like(model.get_parameter(name), full, tp, _vocab_rows(model, name))


def gather_state_dict(model: nn.Module, tp: RankGroup) -> dict[str, torch.Tensor]:
    """Full parameters in the unsharded model's names (tied weights once, as
    ``named_parameters`` lists them). Collective: every tp rank must call it."""
    return {n: gather_param(model, n, p, tp) for n, p in model.named_parameters()}


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor], tp: RankGroup) -> None:
    """Copy this rank's slices of ``full`` (names as ``gather_state_dict``) into ``model``.
    Raises KeyError naming a missing parameter."""
    for n, p in model.named_parameters():
        if n not in full:
            raise KeyError(f"load_full_state_dict: {n!r} missing from the state dict")
        p.copy_(shard_param(model, n, full[n], tp))


def grad_norm(params, tp: RankGroup) -> torch.Tensor:
    """Global L2 norm of the gradients of a tensor-parallel model: squares of sharded
    gradients summed over the tp ranks, replicated gradients counted once (on tp rank 0);
    ``zero.precision.global_norm`` does the sum."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    counted = [is_sharded(p) or tp.rank == 0 for p in params]
    return global_norm(grads, counted, tp.group if tp.size > 1 else "local")[0]


def clip_grad_norm_(params, max_norm: float, tp: RankGroup) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the tp group: scale gradients by
    ``min(1, max_norm / (norm + 1e-6))``; returns the global norm (same on every tp rank)."""
    params = list(params)
    total = grad_norm(params, tp)
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total


def is_partial_grad(p: torch.Tensor) -> bool:
    """A tp-replicated parameter whose gradient each rank holds only a part of, whether or
    not under sequence parallelism (the "partial_grad" style: Qwen3's q_norm / k_norm)."""
    return getattr(p, "tp_partial_grad", False)


def sync_replicated_grads(params, tp: RankGroup, grads: list[torch.Tensor] | None = None,
                          only_partial: bool = False) -> None:
    """Sum the gradients of the tp-replicated parameters among ``params`` over the tp group,
    in one flat all-reduce, in place. Needed under sequence parallelism: there LayerNorms,
    the position embedding and row-parallel biases see only this rank's tokens, so each
    rank holds a partial gradient (Korthikanti et al. 2022, arXiv:2205.05198, section
    4.2.2); and, with or without it, for the parameters of "partial_grad" modules
    (``is_partial_grad``: replicated weights applied to this rank's heads), the only ones
    summed with ``only_partial``. Call after backward (after the last micro-batch) and
    before clipping / the optimizer step.

    ``grads``: the gradients to sum, one per parameter (any shape, e.g. an fp32 master's
    gradient or a ZeRO shard of it); default each parameter's ``.grad`` (None skipped).
    Collective over tp: every tp rank must call it with the same parameters."""
    if tp.size == 1:
        return
    params = list(params)
    grads = [p.grad for p in params] if grads is None else grads
    coalesced_([g for p, g in zip(params, grads) if not is_sharded(p) and g is not None
                and (is_partial_grad(p) or not only_partial)],
               lambda flat: comm.all_reduce(flat, group=tp.group, algorithm=tp.all_reduce,
                                            check=tp.check))


def gather_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                           tp: RankGroup) -> dict[str, dict]:
    """Per-parameter optimizer state (e.g. AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``) in
    the full layout: ``{param name: {key: full tensor | value}}``. Tensors shaped like their
    parameter are gathered like it; scalars are copied. Collective over the tp group."""
    out = {}
    for n, p in model.named_parameters():
        st = optimizer.state.get(p)
        if st:
            out[n] = {k: (gather_param(model, n, v, tp) if torch.is_tensor(v) and v.dim() > 0
                          else v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
    return out


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         full: dict[str, dict], tp: RankGroup) -> None:
    """Inverse of ``gather_optimizer_state`` for this rank's slices (any tp size)."""
    for n, p in model.named_parameters():
        if n in full:
            optimizer.state[p] = {k: (shard_param(model, n, v, tp) if torch.is_tensor(v)
                                      and v.dim() > 0 else v.clone() if torch.is_tensor(v)
                                      else v) for k, v in full[n].items()}
