"""Low-rank adapters on linear layers, in every layout (LoRA: Hu et al. 2021, arXiv:2106.09685).

A targeted linear ``y = x W^T (+ b)`` gets two parameters, ``lora_A`` (r, in) and ``lora_B``
(out, r), and computes ``y + s * dropout(x) A^T B^T`` with ``s = alpha / r``; A is drawn as
PEFT draws it (Kaiming-uniform, a = sqrt(5): uniform(-1/sqrt(in), 1/sqrt(in))), B is zero,
so training starts from the base model. Everything else is frozen (``requires_grad`` False):
the engine's gradient syncs, ZeRO shards, optimizer and checkpoints see the adapters only.

``apply_lora`` runs on the meta device before tensor parallelism: each targeted
``nn.Linear`` becomes a ``LoRALinear`` (the same weight and bias Parameters, same name), so
``parallelize`` carries the adapter into the column- or row-parallel layer it builds
(``split_for_tp``). Under tensor parallelism the adapter is split as its base is, so that it
adds no collective of its own:

- column-parallel (W split by output rows): B is split by output rows as W, A is
  replicated and reads the input after it entered the region; each rank's A gradient is a
  partial sum over its B rows, so A is marked ``tp_partial_grad`` (summed over tp by the
  optimizer, as Qwen3's q_norm);
- row-parallel (W split by input columns): A is split by input columns as W, B is
  replicated; ``x_r A_r^T B^T`` is rank r's partial sum, added to the base's partial sum
  before its one all-reduce (or reduce-scatter), so B's gradient is a partial sum: marked
  ``tp_partial_grad``.

Each adapter's values depend only on the seed and its full name (``init_values``), never on
the layout, so every layout starts from the same adapters as one process.
"""

from __future__ import annotations

import fnmatch
import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

LORA_PARAMS = ("lora_A", "lora_B")
# the styles of a tensor-parallel plan an adapter can follow (models.description)
ADAPTABLE_STYLES = ("column", "row", "replicate", "partial_grad")


def is_lora(name: str) -> bool:
    """Whether parameter ``name`` (a full name) is an adapter's A or B."""
    return name.rpartition(".")[2] in LORA_PARAMS


def targeted(name: str, patterns) -> bool:
    """Whether module ``name`` matches one of ``patterns`` (fnmatch, on the full name or on
    its last part)."""
    last = name.rpartition(".")[2]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(last, p) for p in patterns)


def delta(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The adapter's term ``s * dropout(x) A^T B^T`` of module ``m``: (..., in) -> (..., out)
    (this rank's in / out under tp)."""
    return F.linear(F.linear(m.lora_dropout(x), m.lora_A), m.lora_B) * m.lora_scaling


def has_lora(m: nn.Module) -> bool:
    """Whether ``m`` carries an adapter."""
    return getattr(m, "lora_A", None) is not None


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus an adapter (module docstring). (..., in) -> (..., out)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + delta(self, x)


def add_adapter(m: nn.Module, a: torch.Tensor, b: torch.Tensor, scaling: float,
                dropout: float | nn.Module) -> None:
    """Give ``m`` the adapter ``a`` (r, in), ``b`` (out, r) as Parameters, its scaling and
    its dropout (a probability, or the module to reuse)."""
    m.lora_A, m.lora_B = nn.Parameter(a), nn.Parameter(b)
    m.lora_scaling = scaling
    m.lora_dropout = dropout if isinstance(dropout, nn.Module) else (
        nn.Dropout(dropout) if dropout > 0 else nn.Identity())


def apply_lora(model: nn.Module, patterns, rank: int, alpha: float, dropout: float,
               styles=None) -> list[str]:
    """Each ``nn.Linear`` of ``model`` whose name matches ``patterns`` replaced, in place, by a
    ``LoRALinear`` of rank ``rank`` sharing its weight and bias (on the device they are on:
    meta before the engine shards); every other parameter frozen. ``styles(name)``: the
    tensor-parallel style of a module (only ``ADAPTABLE_STYLES`` take adapters). Returns the
    adapted modules' names. ``ValueError`` (one line, naming lora.targets) when no linear
    matches, a match is the embedding or the head, or a pattern names a weight of an
    "experts" module (a mixture's stacked experts stay frozen)."""
    names = []
    for name, m in list(model.named_modules()):
        if styles is not None and styles(name) == "experts":  # stacked weights: stay frozen
            for p_name, _ in m.named_parameters():
                full = f"{name}.{p_name}"
                if targeted(name, patterns) or targeted(full, patterns):
                    raise ValueError(f"lora.targets: {full} is an expert weight; the experts "
                                     "stay frozen (name the dense layers in full, e.g. "
                                     "blocks.*.self_attn.*)")
        if not (isinstance(m, nn.Linear) and targeted(name, patterns)):
            continue
        style = styles(name) if styles is not None else "replicate"
        if style not in ADAPTABLE_STYLES:
            raise ValueError(f"lora.targets: {name} is a {style} layer; adapters go on the "
                             "blocks' linear layers only")
        new = LoRALinear(m.in_features, m.out_features, bias=m.bias is not None,
                         device="meta")
        new.weight, new.bias = m.weight, m.bias
        w = m.weight
        add_adapter(new, w.new_empty(rank, m.in_features), w.new_empty(m.out_features, rank),
                    alpha / rank, dropout)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
        names.append(name)
    if not names:
        raise ValueError(f"lora.targets={list(patterns)} matches no linear layer of the model")
    for n, p in model.named_parameters():
        p.requires_grad_(is_lora(n))
    return names


def split_for_tp(new: nn.Module, old: nn.Module, style: str, tp) -> None:
    """Carry ``old``'s adapter onto ``new``, its ``style`` (column / row) parallel layer over
    ``tp`` (a ``RankGroup``), split as the module docstring says. Nothing when ``old`` has
    none."""
    if not has_lora(old):
        return

    def shard(t: torch.Tensor, dim: int | None) -> torch.Tensor:  # this rank's 1/N along dim
        if dim is None:
            return t.detach().clone()
        n = tp.shard(t.shape[dim], f"lora: size of dim {dim}")
        return t.detach().narrow(dim, tp.rank * n, n).clone()

    a_dim, b_dim = (None, 0) if style == "column" else (1, None)
    a, b = shard(old.lora_A, a_dim), shard(old.lora_B, b_dim)
    add_adapter(new, a, b, old.lora_scaling, old.lora_dropout)
    for p, dim in ((new.lora_A, a_dim), (new.lora_B, b_dim)):
        if dim is not None:
            p.tp_dim = dim
        else:  # replicated, each rank's gradient a partial sum over tp (module docstring)
            p.tp_partial_grad = True


def full_shape(name: str, local: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """The unsharded shape of adapter parameter ``name`` whose local tensor is ``local``."""
    shape = list(local.shape)
    dim = getattr(local, "tp_dim", None)
    if dim is not None:
        shape[dim] *= tp_size
    return tuple(shape)


def init_values(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full initial value (CPU, fp32) of adapter parameter ``name``: B zeros, A uniform in
    +-1/sqrt(in) (PEFT's Kaiming-uniform with a = sqrt(5)) from a generator seeded by ``seed``
    and the name alone (the same in every layout)."""
    if name.endswith("lora_B"):
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=g)
