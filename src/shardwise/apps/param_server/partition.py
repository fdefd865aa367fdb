"""Key-range partition of the flattened parameters over S servers.

Li et al. (OSDI 2014, "Scaling Distributed Machine Learning with the Parameter Server",
section 4.1) treat the model as (key, value) pairs with ordered keys and give each server a
contiguous key range. Here a key is one parameter tensor (in ``model.parameters()`` order,
a tied weight counted once), its value the tensor flattened; the flat vector is their
concatenation. Server i owns keys ``[cuts[i], cuts[i+1])``, i.e. one contiguous slice
``[lo, hi)`` of the flat vector. The cuts minimise the largest server's bytes (the linear
partition problem, solved exactly by the pipeline's dynamic program,
``parallel.pipeline.partition.balanced``), since a server's traffic per step is
proportional to its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.models import GPT, GPTConfig
from shardwise.parallel.pipeline.partition import balanced


@dataclass(frozen=True)
class Key:
    """One parameter tensor: its name, shape, and place ``[lo, hi)`` in the flat vector."""

    name: str
    shape: tuple[int, ...]
    lo: int
    hi: int
    nbytes: int

    @property
    def numel(self) -> int:
        """Elements in the key (``hi - lo``)."""
        return self.hi - self.lo


@dataclass(frozen=True)
class KeyRanges:
    """Keys in flat order and the key cuts: server i owns ``keys[cuts[i]:cuts[i+1]]``."""

    keys: tuple[Key, ...]
    cuts: tuple[int, ...]

    @property
    def servers(self) -> int:
        """Number of servers the keys are split over."""
        return len(self.cuts) - 1

    @property
    def numel(self) -> int:
        """Elements of the flat vector (the last key's end; 0 without keys)."""
        return self.keys[-1].hi if self.keys else 0

    def server_keys(self, i: int) -> tuple[Key, ...]:
        """The keys server ``i`` holds, in order."""
        return self.keys[self.cuts[i]:self.cuts[i + 1]]

    def bounds(self, i: int) -> tuple[int, int]:
        """Flat slice ``[lo, hi)`` (elements) owned by server ``i``."""
        ks = self.server_keys(i)
        return ks[0].lo, ks[-1].hi

    def server_bytes(self) -> list[int]:
        """Bytes each server holds, one entry per server."""
        return [sum(k.nbytes for k in self.server_keys(i)) for i in range(self.servers)]


def keys_of(model: torch.nn.Module) -> tuple[Key, ...]:
    """The model's parameters as keys, in ``named_parameters()`` order (tied ones once)."""
    keys, lo = [], 0
    for name, p in model.named_parameters():
        keys.append(Key(name, tuple(p.shape), lo, lo + p.numel(), p.numel() * p.element_size()))
        lo += p.numel()
    return tuple(keys)


def partition(model: torch.nn.Module, servers: int) -> KeyRanges:
    """Contiguous key ranges of ``model``'s parameters over ``servers``, balanced by bytes
    (ties: earliest cuts). Raises ``PartitionError`` (a ``ValueError``) when ``servers`` is
    not in ``1..number of keys``."""
    keys = keys_of(model)
    return KeyRanges(keys, balanced([k.nbytes for k in keys], servers).bounds)


def count_keys(model_cfg) -> int:
    """Number of keys (parameter tensors) of the GPT a ``ModelConfig`` describes; built on
    the meta device, so nothing is allocated."""
    m = model_cfg
    with torch.device("meta"):
        gpt = GPT(GPTConfig(vocab_size=max(1, m.vocab_size), block_size=m.block_size,
                            n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd, bias=m.bias,
                            tie_weights=m.tie_weights))
    return sum(1 for _ in gpt.parameters())
