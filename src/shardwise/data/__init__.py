"""Text corpus, character tokenizer and the distributed sampler."""

from shardwise.data.corpus import DataError, load_text, shakespeare_files
from shardwise.data.sampler import DistributedBatchSampler
from shardwise.data.tokenizer import CharTokenizer

__all__ = ["CharTokenizer", "DataError", "DistributedBatchSampler", "load_text", "shakespeare_files"]
