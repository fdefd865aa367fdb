"""Cut a sequential model into contiguous stages (or chunks) of balanced cost.

The GPT counts as ``n_layer + 2`` layers: the embedding, each block, the head. Three ways to
weigh a layer: 1 each (``by="layers"``), its parameter count (``by="params"``), or its
measured forward+backward time (``by="time"``, from ``profile_layers``). Whatever the
weights, one dynamic program picks the contiguous cut that minimises the most expensive
part, the objective of PipeDream's partitioner (Narayanan et al. 2019, section 3.1; without
replication, and with communication left to the schedule).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from shardwise.base.config import PARTITIONS

if TYPE_CHECKING:  # torch only where a layer is profiled: the planner's cuts import none
    import torch
    import torch.nn as nn


class PartitionError(ValueError):
    """The layers cannot be cut as asked (one-line message)."""


@dataclass(frozen=True)
class Partition:
    """``bounds[i]:bounds[i+1]`` are the layers of part ``i``; ``costs[i]`` its total weight.

    ``imbalance`` = slowest part / mean part (1.0 is perfect balance).
    """

    bounds: tuple[int, ...]
    costs: tuple[float, ...]

    @property
    def parts(self) -> int:
        """Number of parts (pipeline stages or chunks)."""
        return len(self.costs)

    def layers(self, part: int) -> range:
        """The layer indices of part ``part``."""
        return range(self.bounds[part], self.bounds[part + 1])

    @property
    def imbalance(self) -> float:
        """Largest part's cost over the mean (1.0: balanced)."""
        mean = sum(self.costs) / len(self.costs)
        return max(self.costs) / mean if mean > 0 else 1.0

    def describe(self) -> str:
        """Each part's layers and cost, and the imbalance, one line each."""
        rows = [f"part {i}: layers {self.bounds[i]}..{self.bounds[i + 1] - 1} cost {c:.4g}"
                for i, c in enumerate(self.costs)]
        return "\n".join(rows + [f"imbalance (max/mean): {self.imbalance:.3f}"])


def balanced(weights: Sequence[float], parts: int) -> Partition:
    """Contiguous cut of ``weights`` into ``parts`` non-empty parts minimising the largest
    part's sum (O(parts * n^2) dynamic program; ties go to the earliest cut).

    Raises ``PartitionError`` when ``parts`` exceeds the number of layers or is < 1.
    """
    n = len(weights)
    if parts < 1:
        raise PartitionError(f"need at least one stage, got {parts}")
    if parts > n:
        raise PartitionError(f"cannot cut {n} layers into {parts} stages: more stages than layers")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][j]: the smallest possible max over the first j layers cut into k parts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j] - 1e-12:
                    best[k][j], cut[k][j] = cost, i
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    costs = tuple(prefix[bounds[i + 1]] - prefix[bounds[i]] for i in range(parts))
    return Partition(tuple(bounds), costs)


def __getattr__(name: str):
    """``gpt_layers``: ``models.description.decoder_layers`` (``[("embed", ...), ("blocks.0",
    ...), ..., ("head", ...)]`` of a shardwise GPT or Llama), loaded on first use (torch.nn)."""
    if name == "gpt_layers":
        from shardwise.models.description import decoder_layers

        globals()[name] = decoder_layers
        return decoder_layers
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class LayerProfile:
    """Per layer: forward+backward seconds (median of repeats) and output activation bytes."""

    seconds: tuple[float, ...]
    activation_bytes: tuple[int, ...]
    params: tuple[int, ...]


def profile_layers(layers: Sequence[nn.Module], sample: torch.Tensor, repeats: int = 5) -> LayerProfile:
    """Time each layer's forward+backward on the activations the previous one produces.

    ``sample`` is the first layer's input (for the GPT: token ids (B, T)), on the device the
    layers are on. Times are the median over ``repeats`` runs after one warm-up, in seconds
    (on CUDA, synchronised before and after each run).
    """
    import torch

    seconds, act, params = [], [], []
    x = sample
    sync = torch.cuda.synchronize if sample.device.type == "cuda" else (lambda: None)
    for layer in layers:
        inp = x.detach().requires_grad_(x.is_floating_point())
        runs = []
        for i in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            y = layer(inp)
            y.backward(torch.ones_like(y))
            sync()
            if i:
                runs.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
        seconds.append(sorted(runs)[len(runs) // 2])
        act.append(y.numel() * y.element_size())
        params.append(sum(p.numel() for p in layer.parameters()))
        x = y.detach()
    return LayerProfile(tuple(seconds), tuple(act), tuple(params))


def partition_layers(layers: Sequence[nn.Module], parts: int, by: str = "layers",
                     sample: torch.Tensor | None = None) -> Partition:
    """Cut ``layers`` into ``parts`` by ``"layers"`` (count), ``"params"`` or ``"time"``
    (profiled on ``sample``, which is then required)."""
    if by == "layers":
        weights = [1.0] * len(layers)
    elif by == "params":
        weights = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
    elif by == "time":
        if sample is None:
            raise PartitionError("partitioning by time needs a sample input to profile")
        weights = list(profile_layers(layers, sample).seconds)
    else:
        raise PartitionError(f"unknown partition weight {by!r}; expected "
                             f"{', '.join(PARTITIONS)}")  # parallel.partition's choices
    return balanced(weights, parts)
