"""How ZeRO cuts the flattened parameters into per-rank shards.

Parameters are packed into buckets exactly as our DDP packs gradients (reverse
registration order, ``bucket_mb``). A bucket of ``n`` elements is padded to
``n_pad = ceil(n / N) * N`` and rank ``r`` owns elements ``[r * n_pad/N, (r+1) * n_pad/N)``
of it, so every collective on a bucket is an even reduce-scatter or all-gather. With one
bucket (the default 25 MiB holds small models whole) each rank owns one contiguous 1/N
slice of all parameters, as in Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC 2020. Padding is at most N-1 elements per bucket;
``zero.memory.report`` states it (``padded_numel - numel``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.parallel.data_parallel.buckets import Bucket, build_buckets


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls in this rank's shard of its bucket.

    ``param_start:param_end`` index the flattened parameter; ``shard_start`` is where the
    piece begins inside the rank's shard of the bucket.
    """

    bucket: int
    param_index: int  # index within the bucket
    param_start: int
    param_end: int
    shard_start: int

    @property
    def numel(self) -> int:
        """Length in elements, the same in the flat parameter and in the shard."""
        return self.param_end - self.param_start


class ShardLayout:
    """Buckets of parameters and this rank's shard of each.

    Args:
        params: trainable parameters in registration order.
        world_size, rank: the dp group's size N and this rank's index in it.
        cap_bytes: bucket capacity.
        isolate: ids of parameters that get a bucket of their own (``build_buckets``).
    """

    def __init__(self, params: list[torch.nn.Parameter], world_size: int, rank: int,
                 cap_bytes: int, isolate: frozenset[int] = frozenset()):
        self.world_size, self.rank = world_size, rank
        # buffers padded to N: they are the reduce-scatter inputs of ZeRO-1 (stage 2 drops them)
        self.buckets: list[Bucket] = build_buckets(params, cap_bytes, pad_to=world_size,
                                                   isolate=isolate)
        self.padded: list[int] = [b.buffer.numel() for b in self.buckets]
        self.shard_sizes: list[int] = [n // world_size for n in self.padded]
        self.pieces: list[Piece] = []
        for bi, b in enumerate(self.buckets):
            lo = rank * self.shard_sizes[bi]
            hi = lo + self.shard_sizes[bi]
            for pi, p in enumerate(b.params):
                start, end = b.offsets[pi], b.offsets[pi] + p.numel()
                a, z = max(start, lo), min(end, hi)
                if a < z:
                    self.pieces.append(Piece(bi, pi, a - start, z - start, a - lo))

    @property
    def numel(self) -> int:
        """P: trainable parameters, unpadded."""
        return sum(b.numel for b in self.buckets)

    @property
    def shard_numel(self) -> int:
        """Elements this rank owns (padding included): sum over buckets of n_pad / N."""
        return sum(self.shard_sizes)
