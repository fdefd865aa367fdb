"""Text corpus, tokenizers (character, Hugging Face), prepared token shards and the
distributed sampler. ``prepare`` (the ``shardwise prepare`` pipeline) imports ``datasets``
and ``tokenizers`` when it runs, not here."""

from shardwise.data.corpus import DataError, load_text, shakespeare_files
from shardwise.data.sampler import DistributedBatchSampler
from shardwise.data.tokenizer import CharTokenizer, HFTokenizer, tokenizer_from_state

__all__ = ["CharTokenizer", "DataError", "DistributedBatchSampler", "HFTokenizer", "load_text",
           "shakespeare_files", "tokenizer_from_state"]
