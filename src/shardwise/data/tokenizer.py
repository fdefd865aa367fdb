"""Tokenizers a run trains with: our character tokenizer, or a Hugging Face ``tokenizers``
one (a byte-level BPE that ``shardwise prepare`` trained, or any ``tokenizer.json``).

``torch`` is imported when ``encode`` first runs: ``shardwise prepare`` never needs it.

Both give ``vocab_size``, ``encode`` (text -> int64 ids), ``decode``, ``start_ids`` (the
prompt a sample starts from) and a JSON-safe ``state_dict`` that a checkpoint stores beside
its tensors; ``tokenizer_from_state`` rebuilds either from it without unpickling.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class CharTokenizer:
    """Maps characters to ids ``0..V-1`` in sorted code-point order.

    ``state_dict()`` is JSON-safe (the vocabulary string), so it is stored beside a
    checkpoint and reloaded without unpickling.
    """

    kind = "char"

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars):
            raise ValueError("tokenizer vocabulary has repeated characters")
        self.chars = chars
        self._stoi = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """The tokenizer of the characters of ``text``, sorted (ids in code-point order)."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        """Number of ids (distinct characters)."""
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """``text`` -> int64 tensor of shape ``(len(text),)``; unknown characters raise KeyError."""
        import torch

        return torch.tensor([self._stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        """Ids (any iterable of ints or a tensor) -> their characters joined."""
        return "".join(self.chars[int(i)] for i in ids)

    def start_ids(self) -> list[int]:
        """The prompt of a generated sample: a newline."""
        return self.encode("\n").tolist()

    def state_dict(self) -> dict:
        """What a checkpoint stores: ``{kind: char, chars}``."""
        return {"kind": "char", "chars": self.chars}

    @classmethod
    def from_state_dict(cls, state: dict) -> "CharTokenizer":
        """The tokenizer ``state_dict()`` described."""
        return cls(state["chars"])

    def to_json(self) -> str:
        """``state_dict()`` as JSON text (UTF-8 kept)."""
        return json.dumps(self.state_dict(), ensure_ascii=False)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (Hugging Face's Rust tokenizers: a ``tokenizer.json``)
    behind the interface of ``CharTokenizer``.

    ``encode`` adds no special tokens (no BOS, no post-processor): documents are joined by
    ``eos_id``, the end-of-text token, when the tokenizer has one. ``vocab_size`` is one more
    than the largest id, added tokens included. ``tokenizers`` is imported when one is built.
    """

    kind = "hf"

    def __init__(self, tokenizer, eos_id: int | None = None):
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self._vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    @classmethod
    def from_str(cls, text: str, eos_id: int | None = None) -> "HFTokenizer":
        """From the text of a ``tokenizer.json``; ``ValueError`` if it does not parse."""
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_str(text), eos_id)
        except Exception as e:  # tokenizers raises its own Exception subclass
            raise ValueError(f"not a tokenizer.json: {str(e).splitlines()[0]}") from None

    @property
    def vocab_size(self) -> int:
        """Number of ids: the largest id of the vocabulary (added tokens included) plus one."""
        return self._vocab_size

    def encode(self, text: str) -> torch.Tensor:
        """``text`` -> int64 tensor ``(n,)``: the ids ``tokenizers`` gives, no special tokens."""
        import torch

        return torch.tensor(self.tokenizer.encode(text, add_special_tokens=False).ids,
                            dtype=torch.long)

    def decode(self, ids) -> str:
        """Ids (any iterable of ints or a tensor) -> text, special tokens kept."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def start_ids(self) -> list[int]:
        """The prompt of a generated sample: the end-of-text token (a document starts after
        it), else a newline's last token, else id 0."""
        if self.eos_id is not None:
            return [self.eos_id]
        return self.encode("\n").tolist()[-1:] or [0]

    def state_dict(self) -> dict:
        """JSON-safe: the whole ``tokenizer.json`` text, so a checkpoint is self-contained."""
        return {"kind": "hf", "json": self.tokenizer.to_str(), "eos_id": self.eos_id}

    @classmethod
    def from_state_dict(cls, state: dict) -> "HFTokenizer":
        """The tokenizer ``state_dict()`` described (its tokenizer.json text and ``eos_id``)."""
        return cls.from_str(state["json"], state.get("eos_id"))


def tokenizer_from_state(state: dict) -> CharTokenizer | HFTokenizer:
    """The tokenizer a ``state_dict()`` describes (``kind`` char or hf); ``ValueError``
    for another kind."""
    kind = state.get("kind", "char")
    if kind == "char":
        return CharTokenizer.from_state_dict(state)
    if kind == "hf":
        return HFTokenizer.from_state_dict(state)
    raise ValueError(f"unknown tokenizer kind {kind!r}")


def tokenizer_fingerprint(tokenizer: CharTokenizer | HFTokenizer) -> str:
    """sha256 (hex) of the tokenizer's ``state_dict`` as canonical JSON: equal for two
    tokenizers that encode alike."""
    text = json.dumps(tokenizer.state_dict(), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
