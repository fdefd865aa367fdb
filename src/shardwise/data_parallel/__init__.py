"""Data parallelism: our own DDP (bucketed, overlapped all-reduce; no_sync accumulation)."""

from shardwise.data_parallel.buckets import Bucket, build_buckets
from shardwise.data_parallel.ddp import DistributedDataParallel

__all__ = ["Bucket", "DistributedDataParallel", "build_buckets"]
