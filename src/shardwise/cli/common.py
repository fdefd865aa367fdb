"""What every command shares: the exit code for bad input, an argparse parser whose errors
are one line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors print one line and exit with ``EXIT_USAGE``
    (argparse's default prints the usage too).

    ``late_arguments``: a function that adds more arguments, called once, the first time
    this parser parses or prints its help (``shardwise train``'s config options import
    pydantic; ``shardwise --help`` and the other commands need not pay for it)."""

    def __init__(self, *args, late_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self._late_arguments = late_arguments

    def _add_late_arguments(self) -> None:
        if self._late_arguments is not None:
            add, self._late_arguments = self._late_arguments, None
            add(self)

    def parse_known_args(self, args=None, namespace=None):
        self._add_late_arguments()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._add_late_arguments()
        return super().format_help()

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def split_overrides(extra: list[str]) -> dict:
    """``["--parallel.tp", "2", "--model.kind=llama"]`` -> ``{"parallel.tp": 2, "model.kind":
    "llama"}`` (values as TOML literals); ``ConfigError`` (one line) for anything else."""
    from shardwise.base.config import ConfigError, parse_override_value

    out, i = {}, 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--") or "." not in tok:
            raise ConfigError(f"unrecognised argument {tok!r}; overrides look like --section.field VALUE")
        key, eq, val = tok[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra):
                raise ConfigError(f"--{key}: missing value")
            val, i = extra[i + 1], i + 1
        out[key] = parse_override_value(val)
        i += 1
    return out
