"""The language model's data: a character-level tokenizer over the corpus and the split into
training and validation tokens (the tail of the text is held out)."""

from __future__ import annotations

import torch

from shardwise.base.config import Config
from shardwise.data import CharTokenizer, load_text


def n_val_tokens(cfg: Config, n: int) -> int:
    """Validation tail of a corpus of ``n`` tokens: ``max(block_size + 1, n * val_fraction)``
    (at least one window of ``model.block_size + 1`` tokens)."""
    return max(cfg.model.block_size + 1, int(n * cfg.data.val_fraction))


def split_corpus(cfg: Config, tokenizer: CharTokenizer | None = None
                 ) -> tuple[CharTokenizer, torch.Tensor, torch.Tensor]:
    """``(tokenizer, train_tokens, val_tokens)`` of ``data.path`` (Shakespeare when unset):
    ``tokenizer`` (a resumed run's) or one built from the text's characters; 1-D int64
    tensors, the validation part the last ``n_val_tokens`` of the text. Raises ``DataError``
    for a missing or unreadable file."""
    text = load_text(cfg.data.path)
    tokenizer = tokenizer or CharTokenizer.from_text(text)
    tokens = tokenizer.encode(text)
    n_val = n_val_tokens(cfg, len(tokens))
    return tokenizer, tokens[:-n_val], tokens[-n_val:]


def check_corpus(cfg: Config, text: str | None = None) -> None:
    """At the door: ``data.path`` must be readable (``DataError``) and leave one global batch
    of training windows after the validation split (``ValueError``, one line). ``text``:
    the corpus when the caller has read it already."""
    n_chars = len(load_text(cfg.data.path) if text is None else text)
    T, G = cfg.model.block_size, cfg.training.global_batch_size
    windows = max(0, (n_chars - n_val_tokens(cfg, n_chars) - 1) // T)
    if windows < G:
        raise ValueError(f"data.path: {cfg.data.path or 'the corpus'} holds {n_chars:,} "
                         f"characters: {windows} training windows of model.block_size+1={T + 1} after the "
                         f"validation split, fewer than training.global_batch_size={G}")
