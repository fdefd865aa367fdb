"""Load-balanced causal sharding of a sequence over cp ranks.

The sequence of length T is cut into ``2 cp`` chunks of ``c = T / (2 cp)`` tokens; rank ``i``
holds chunks ``i`` and ``2cp-1-i``, in that order (Megatron-LM's context parallelism and
PyTorch's ``_HeadTailLoadBalancer``, which torchtitan uses; Brandon et al. 2023, "Striped Attention", discuss
the same imbalance). Under a causal mask, a query in chunk ``a`` attends to the keys of
chunks ``<= a``; pairing an early chunk with a late one gives every rank the same work,
``i + 1/2 + (2cp-1-i) + 1/2 = 2cp`` blocks of ``c x c`` scores (a diagonal block counting half),
where the contiguous cut (chunks ``2i`` and ``2i+1``) would give rank ``i`` ``4i + 2`` of them:
the last rank ``2cp - 1`` times the first's.

Shapes: ``shard_sequence`` takes any tensor with the sequence along ``dim`` (token ids
(B, T), targets, activations (B, T, C)) and returns (.., T / cp, ..); ``local_positions``
the (T / cp,) int64 positions of those tokens in the whole sequence.
"""

from __future__ import annotations

import torch


def check_length(T: int, cp: int) -> int:
    """The chunk length ``T / (2 cp)``; ``ValueError`` (one line) when ``T`` is not divisible
    by ``2 cp``."""
    if T % (2 * cp):
        raise ValueError(f"sequence length {T} is not divisible by 2 x cp = {2 * cp} (each "
                         "context-parallel rank holds chunks i and 2cp-1-i of every sequence)")
    return T // (2 * cp)


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two chunk indices rank ``rank`` of ``cp`` holds: ``(rank, 2cp-1-rank)``."""
    return rank, 2 * cp - 1 - rank


def local_positions(T: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """(T / cp,) int64: positions in the whole sequence of rank ``rank``'s tokens, in local
    order (its first chunk, then its second)."""
    c = check_length(T, cp)
    a, b = chunks_of(rank, cp)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device),
                      torch.arange(b * c, (b + 1) * c, device=device)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``x`` along ``dim``: chunks ``rank`` and ``2cp-1-rank``
    concatenated (a new tensor; ``x`` itself when cp = 1). ``ValueError`` when the length is
    not divisible by ``2 cp``."""
    if cp == 1:
        return x
    c = check_length(x.shape[dim], cp)
    a, b = chunks_of(rank, cp)
    return torch.cat([x.narrow(dim, a * c, c), x.narrow(dim, b * c, c)], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard_sequence``: every rank's shard (``parts[i]`` of rank i) back into
    the whole sequence along ``dim``. For tests and tools."""
    cp = len(parts)
    c = parts[0].shape[dim] // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, p in enumerate(parts):
        a, b = chunks_of(r, cp)
        chunks[a], chunks[b] = p.narrow(dim, 0, c), p.narrow(dim, c, c)
    return torch.cat(chunks, dim=dim)
