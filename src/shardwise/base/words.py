"""Words of the lines shardwise prints: a count with its noun in the right number."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``count(1, "thread")`` -> ``"1 thread"``, ``count(1234, "document")`` -> ``"1,234
    documents"``; ``plural``: the noun's plural when it is not ``noun + "s"``."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
