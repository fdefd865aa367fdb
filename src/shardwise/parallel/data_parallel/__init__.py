"""Data parallelism: our own DDP (bucketed, overlapped all-reduce; no_sync accumulation), and
``GradientSync`` (the same buckets for engines with many backwards per step: the pipeline)."""

from shardwise.parallel.data_parallel.buckets import Bucket, build_buckets
from shardwise.parallel.data_parallel.ddp import DistributedDataParallel
from shardwise.parallel.data_parallel.grad_sync import GradientSync

__all__ = ["Bucket", "DistributedDataParallel", "GradientSync", "build_buckets"]
