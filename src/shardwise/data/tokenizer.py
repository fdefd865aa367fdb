"""Character-level tokenizer: one id per distinct character of the corpus."""

from __future__ import annotations

import json

import torch


class CharTokenizer:
    """Maps characters to ids ``0..V-1`` in sorted code-point order.

    ``state_dict()`` is JSON-safe (the vocabulary string), so it is stored beside a
    checkpoint and reloaded without unpickling.
    """

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars):
            raise ValueError("tokenizer vocabulary has repeated characters")
        self.chars = chars
        self._stoi = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """``text`` -> int64 tensor of shape ``(len(text),)``; unknown characters raise KeyError."""
        return torch.tensor([self._stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def state_dict(self) -> dict:
        return {"kind": "char", "chars": self.chars}

    @classmethod
    def from_state_dict(cls, state: dict) -> "CharTokenizer":
        return cls(state["chars"])

    def to_json(self) -> str:
        return json.dumps(self.state_dict(), ensure_ascii=False)
