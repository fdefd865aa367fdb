"""Stage partitioning: the dynamic program is optimal; counts, params, profiled times."""

import itertools
import random

import pytest
import torch

from shardwise.models import GPT, GPTConfig
from shardwise.parallel.pipeline.partition import (
    PartitionError,
    balanced,
    gpt_layers,
    partition_layers,
    profile_layers,
)


def brute_force(weights, parts):
    n, best = len(weights), float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        b = (0,) + cuts + (n,)
        best = min(best, max(sum(weights[b[i]:b[i + 1]]) for i in range(parts)))
    return best


def test_balanced_is_optimal():
    g = torch.Generator().manual_seed(0)
    for n in range(1, 9):
        for parts in range(1, n + 1):
            w = torch.rand(n, generator=g).tolist()
            p = balanced(w, parts)
            assert p.bounds[0] == 0 and p.bounds[-1] == n and len(p.costs) == parts
            assert all(p.bounds[i] < p.bounds[i + 1] for i in range(parts))
            assert max(p.costs) == pytest.approx(brute_force(w, parts))
            assert p.imbalance >= 1.0


def test_balanced_is_exact_on_integer_sizes():
    """The parameter server's key ranges (bytes per key): contiguous, non-empty, optimal."""
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 50) for _ in range(rng.randint(1, 8))]
        for parts in range(1, len(sizes) + 1):
            cuts = balanced(sizes, parts).bounds
            assert cuts[0] == 0 and cuts[-1] == len(sizes) and len(cuts) == parts + 1
            assert all(a < b for a, b in zip(cuts, cuts[1:]))  # every range non-empty
            got = max(sum(sizes[a:b]) for a, b in zip(cuts, cuts[1:]))
            assert got == brute_force(sizes, parts)
    with pytest.raises(ValueError):
        balanced([1, 2], 3)


def test_gpt_partitions():
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=6, n_embd=32, tie_weights=False))
    layers = [m for _, m in gpt_layers(model)]
    assert partition_layers(layers, 4).bounds == (0, 2, 4, 6, 8)
    by_params = partition_layers(layers, 2, by="params")
    assert by_params.imbalance < 1.2 and "imbalance" in by_params.describe()
    prof = profile_layers(layers, torch.zeros(2, 16, dtype=torch.long), repeats=2)
    assert len(prof.seconds) == 8 and all(s > 0 for s in prof.seconds)
    assert prof.activation_bytes[1] == 2 * 16 * 32 * 4
    assert partition_layers(layers, 3, by="time", sample=torch.zeros(2, 16, dtype=torch.long)).parts == 3
    with pytest.raises(PartitionError, match="more stages than layers"):
        balanced([1.0] * 3, 4)
    with pytest.raises(PartitionError, match="unknown partition weight"):
        partition_layers(layers, 2, by="flops")
