"""Text corpus, tokenizers (character, Hugging Face), prepared token shards and the
distributed sampler. ``prepare`` (the ``shardwise prepare`` pipeline) imports ``datasets``
and ``tokenizers`` when it runs; torch is imported with the sampler, on first use, so
``shardwise prepare`` runs without it."""

from shardwise.data.corpus import DataError, load_text, shakespeare_files
from shardwise.data.tokenizer import CharTokenizer, HFTokenizer, tokenizer_from_state

__all__ = ["CharTokenizer", "DataError", "DistributedBatchSampler", "HFTokenizer", "load_text",
           "shakespeare_files", "tokenizer_from_state"]


def __getattr__(name: str):
    if name == "DistributedBatchSampler":  # imports torch: only when asked (PEP 562)
        from shardwise.data.sampler import DistributedBatchSampler

        return DistributedBatchSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
