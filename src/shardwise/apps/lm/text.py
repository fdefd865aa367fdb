"""The language model's data: a UTF-8 text (the character tokenizer over its characters, the
tail held out), or a directory of token shards that ``shardwise prepare`` wrote (its
tokenizer, its split, memory-mapped)."""

from __future__ import annotations

import torch

from shardwise.base.config import Config
from shardwise.data import CharTokenizer, DataError, load_text
from shardwise.data.shards import TokenStream, is_prepared_dir, load_prepared, verify
from shardwise.data.tokenizer import HFTokenizer, tokenizer_fingerprint

Tokens = torch.Tensor | TokenStream  # 1-D: a tensor, or shards indexed like one


def n_val_tokens(cfg: Config, n: int) -> int:
    """Validation tail of a corpus of ``n`` tokens: ``max(block_size + 1, n * val_fraction)``
    (at least one window of ``model.block_size + 1`` tokens)."""
    return max(cfg.model.block_size + 1, int(n * cfg.data.val_fraction))


def split_corpus(cfg: Config, tokenizer: CharTokenizer | HFTokenizer | None = None
                 ) -> tuple[CharTokenizer | HFTokenizer, Tokens, Tokens]:
    """``(tokenizer, train_tokens, val_tokens)`` of ``data.path`` (Shakespeare when unset).

    A text file: ``tokenizer`` (a resumed run's) or one built from the text's characters;
    1-D int64 tensors, the validation part the last ``n_val_tokens`` of the text. A prepared
    directory: the manifest's tokenizer (the door checked it against a resumed run's) and its
    two splits as ``TokenStream``s, which index like 1-D int64 tensors and read only the
    positions asked. Raises ``DataError`` for a missing or unreadable file."""
    if is_prepared_dir(cfg.data.path):
        data = load_prepared(cfg.data.path)  # sizes checked; checksums at the door
        return data.tokenizer, data.train, data.val
    text = load_text(cfg.data.path)
    tokenizer = tokenizer or CharTokenizer.from_text(text)
    tokens = tokenizer.encode(text)
    n_val = n_val_tokens(cfg, len(tokens))
    return tokenizer, tokens[:-n_val], tokens[-n_val:]


def loss_masks(cfg: Config) -> tuple:
    """The train and val splits' loss masks (uint8 ``TokenStream``s, 1: a target) of a
    prepared chat directory; (None, None) for every other corpus (every token a target)."""
    if not is_prepared_dir(cfg.data.path):
        return None, None
    data = load_prepared(cfg.data.path)
    return data.train_mask, data.val_mask


def check_corpus(cfg: Config, text: str | None = None) -> None:
    """At the door: ``data.path`` must be readable (``DataError``) and leave one global batch
    of training windows after the validation split (``ValueError``, one line). A prepared
    directory: its manifest, every shard's size and sha256 (``DataError``), a vocabulary no
    larger than ``model.vocab_size`` when that is set, one validation window. ``text``: the
    corpus when the caller has read it already (a text file)."""
    T, G = cfg.model.block_size, cfg.training.global_batch_size
    if is_prepared_dir(cfg.data.path):
        m = verify(cfg.data.path)
        if cfg.model.vocab_size and m["vocab_size"] > cfg.model.vocab_size:
            raise DataError(f"data.path: {cfg.data.path}'s tokenizer has {m['vocab_size']:,} "
                            f"ids, more than model.vocab_size={cfg.model.vocab_size:,}")
        n_train, n_val = m["tokens"]["train"], m["tokens"]["val"]
        windows = max(0, (n_train - 1) // T)
        if windows < G:
            raise ValueError(f"data.path: {cfg.data.path} holds {n_train:,} training tokens: "
                             f"{windows} windows of model.block_size+1={T + 1}, fewer than "
                             f"training.global_batch_size={G}")
        if n_val < T + 1:
            raise ValueError(f"data.path: {cfg.data.path} holds {n_val:,} validation tokens, "
                             f"fewer than one window of model.block_size+1={T + 1}; prepare "
                             "it with a larger --val-fraction")
        return
    n_chars = len(load_text(cfg.data.path) if text is None else text)
    windows = max(0, (n_chars - n_val_tokens(cfg, n_chars) - 1) // T)
    if windows < G:
        raise ValueError(f"data.path: {cfg.data.path or 'the corpus'} holds {n_chars:,} "
                         f"characters: {windows} training windows of model.block_size+1={T + 1} after the "
                         f"validation split, fewer than training.global_batch_size={G}")


def check_tokenizer(cfg: Config, saved: dict | None) -> None:
    """A run resuming on a prepared directory must find the tokenizer its checkpoint
    trained with (``saved``: the checkpoint's ``tokenizer`` state); ``DataError`` if the
    directory was prepared again with another."""
    if saved is None or not is_prepared_dir(cfg.data.path):
        return
    from shardwise.data.shards import load_tokenizer, read_manifest
    from shardwise.data.tokenizer import tokenizer_from_state

    ours = load_tokenizer(cfg.data.path, read_manifest(cfg.data.path))
    if tokenizer_fingerprint(tokenizer_from_state(saved)) != tokenizer_fingerprint(ours):
        raise DataError(f"data.path: {cfg.data.path}'s tokenizer is not the one the "
                        "checkpoint trained with (prepared again?); --fresh starts over")


def token_unit(tokenizer) -> str:
    """What one token is, for the loss's unit: ``char`` or ``token``."""
    return "char" if isinstance(tokenizer, CharTokenizer) else "token"
