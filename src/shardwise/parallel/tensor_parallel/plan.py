"""Apply a model's tensor-parallel plan (``models.description``) to one of its layers.

``parallelize(layer, plan, tp, rng, name=..., vocab_size=...)`` replaces, in place, each submodule of
``layer`` (named ``name`` in the full model) that the plan gives a style: ``nn.Linear`` by
``ColumnParallelLinear`` / ``RowParallelLinear``, ``nn.Embedding`` by
``VocabParallelEmbedding``, ``nn.Dropout`` by ``TPDropout``; ``attention``,
``shared_input``, ``sequence_positions`` and (under SP) ``moe`` modules get forward hooks. Each sharded
module is built from the module it replaces (its ``master``), so, slice for slice, the
result equals the layer it came from; on the meta device it stays on meta (the engine
shards before it materialises). Replacing keeps each submodule's name and place, so
parameter names and order stay the single-process model's.

The communication is Megatron-LM's (Shoeybi et al. 2019, arXiv:1909.08053, figure 3):
one ``f`` (or a sequence all-gather under SP, Korthikanti et al. 2022) where a region is
entered, one ``g`` (all-reduce, or reduce-scatter under SP) after each row-parallel layer
and the vocab-parallel embedding. Source for the plan idea: PyTorch's
``torch.distributed.tensor.parallel.parallelize_module``.

A ``moe`` module (a mixture of experts) under SP is one region around all its children, as
a dense MLP is (Korthikanti et al. 2022, figure 5): its input is all-gathered along the
sequence once (backward: reduce-scatter), so the router sees the whole sequence as without
SP; inside, nothing communicates over tp (``in_sequence_region``: column layers do not
enter, row layers do not reduce, the ``experts`` style skips its f and g), every rank's
output being a partial sum over its width slices; the sum is reduce-scattered along the
sequence on the way out (backward: all-gather). Without SP the style does nothing.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Mapping

import torch
import torch.nn as nn

from shardwise.models.description import ModelDescription, style_of
from shardwise.parallel.lora import split_for_tp
from shardwise.parallel.tensor_parallel.group import RankGroup
from shardwise.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    enter_region,
    padded_vocab_size,
)
from shardwise.parallel.tensor_parallel.mappings import reduce_scatter_to_sequence
from shardwise.parallel.tensor_parallel.random import ParallelRNG, TPDropout

_ENTERING = ("attention", "shared_input")


def in_sequence_region(plan: Mapping[str, str], name: str, tp: RankGroup) -> bool:
    """Whether module ``name`` (a full name) lies inside a ``moe`` module of ``plan`` under
    sequence parallelism: its tp communication is the region's (module docstring)."""
    return tp.sequence_parallel and any(style_of(plan, a) == "moe" for a in _ancestors(name))


def check_divisible(description: ModelDescription, tp: RankGroup) -> None:
    """Raise ValueError (one line) naming the first of the model's ``tp_divides`` that tp
    does not divide. (The sequence under sequence parallelism is the config's rule,
    ``Config``; each forward's position hook splits it with ``tp.shard``.)"""
    for what, n in description.tp_divides.items():
        tp.shard(n, what)


def parallelize(layer: nn.Module, plan: Mapping[str, str], tp: RankGroup, rng: ParallelRNG,
                *, name: str = "", vocab_size: int | None = None) -> nn.Module:
    """``layer`` (module ``name`` of the full model, "" for the model itself) with its
    submodules split over ``tp`` by ``plan`` (module-name pattern -> style, on full names:
    ``ModelDescription.tp_plan``); ``rng`` draws the dropout masks of parallel regions;
    ``vocab_size``: the real rows of a ``vocab_head`` (its padding is zero). Returns the
    layer (itself, or its replacement when the plan names the layer)."""
    styles = {}
    for sub, _ in layer.named_modules():
        full = ".".join(x for x in (name, sub) if x)
        style = style_of(plan, full)
        if style != "replicate":
            styles[sub] = style
    for sub, style in sorted(styles.items(), key=lambda kv: -kv[0].count(".")):
        module = layer.get_submodule(sub) if sub else layer
        tag = ".".join(x for x in (name, sub) if x)  # names its collectives (per_layer_table)
        region = in_sequence_region(plan, tag, tp)
        entered = region or any(styles.get(a) in _ENTERING for a in _ancestors(sub))
        new = _apply(style, module, tp, rng, vocab_size, entered, tag, region)
        if new is module:
            continue
        if not sub:
            layer = new
        else:
            parent, _, attr = sub.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, attr, new)
    return layer


def _ancestors(sub: str) -> list[str]:
    parts = sub.split(".") if sub else []
    return [".".join(parts[:i]) for i in range(len(parts))]


def _apply(style: str, m: nn.Module, tp: RankGroup, rng: ParallelRNG,
           vocab_size: int | None, entered: bool, tag: str, region: bool = False) -> nn.Module:
    if style == "column":
        new = ColumnParallelLinear(m.in_features, m.out_features, tp, m.bias is not None,
                                   master=m, tag=tag, enters=not entered)
        split_for_tp(new, m, style, tp)  # a LoRA adapter, split as the base
        return new
    if style == "row":
        new = RowParallelLinear(m.in_features, m.out_features, tp, m.bias is not None,
                                input_is_parallel=True, master=m, tag=tag,
                                reduces=not region)
        split_for_tp(new, m, style, tp)
        return new
    if style == "vocab_embedding":
        return VocabParallelEmbedding(m.num_embeddings, m.embedding_dim, tp, master=m,
                                      tag=tag)
    if style == "vocab_head":
        return _vocab_head(m, tp, m.out_features if vocab_size is None else vocab_size, tag)
    if style == "dropout":
        return TPDropout(m.p, rng, parallel=tp.sequence_parallel)
    if style == "moe" and tp.sequence_parallel and not region:
        m.register_forward_pre_hook(_enter_hook(tp, f"{tag}.input"))  # all-gather
        m.register_forward_hook(_leave_hook(tp, f"{tag}.output"))      # reduce-scatter
        return m
    if style in _ENTERING:
        if not region:  # a region's input has entered already
            m.register_forward_pre_hook(_enter_hook(tp, f"{tag}.input"))
        if style == "attention":  # this rank's heads: its own dropout masks
            m.register_forward_pre_hook(lambda mod, args: rng.enter() if mod.training else None)
            m.register_forward_hook(lambda mod, args, out: rng.exit() if mod.training else None)
        return m
    if style == "sequence_positions" and tp.sequence_parallel:
        m.register_forward_pre_hook(_positions_hook(tp))
    if style == "partial_grad":  # replicated, but each rank's gradient is a part of the sum
        for p in m.parameters():
            p.tp_partial_grad = True
    return m  # sequence_parallel / replicate: the module is token-wise or replicated


def _enter_hook(tp: RankGroup, tag: str):
    """Forward pre-hook: the first input enters the region (f, or the SP all-gather)."""
    def hook(module, args):
        return (enter_region(args[0], tp, tag),) + tuple(args[1:])
    return hook


def _leave_hook(tp: RankGroup, tag: str):
    """Forward hook: a region's partial sums (B, T, C) leave it reduce-scattered along the
    sequence, (B, T / N, C) (sequence parallelism's g)."""
    def hook(module, args, out):
        return reduce_scatter_to_sequence(out, tp, tag=tag)
    return hook


def _positions_hook(tp: RankGroup):
    """Forward pre-hook: position ids (T,) or (B, T) -> this rank's slice of the sequence."""
    def hook(module, args):
        pos = args[0]
        n = tp.shard(pos.shape[-1], "sequence length (sequence parallelism splits it)")
        return (pos[..., tp.rank * n:(tp.rank + 1) * n],) + tuple(args[1:])
    return hook


def _vocab_head(m: nn.Linear, tp: RankGroup, vocab_size: int, tag: str) -> ColumnParallelLinear:
    """The projection to the vocabulary, its rows padded to a multiple of tp with zeros
    (``padded_vocab_size``), column-parallel: (.., C) -> (.., V_pad / tp) logits."""
    c, padded = m.in_features, padded_vocab_size(vocab_size, tp.size)
    with torch.no_grad():
        weight = m.weight.new_zeros(padded, c)  # meta on meta
        weight[:vocab_size] = m.weight
    return ColumnParallelLinear(c, padded, tp, bias=False,
                                master=SimpleNamespace(weight=weight, bias=None), tag=tag)
