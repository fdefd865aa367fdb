"""What every command shares: the exit code for bad input, an argparse parser whose errors
are one line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors print one line and exit with ``EXIT_USAGE``
    (argparse's default prints the usage too).

    ``late_arguments``: a function that adds more arguments, called once, the first time
    this parser parses or prints its help (``shardwise train``'s config options import
    pydantic; ``shardwise --help`` and the other commands need not pay for it)."""

    def __init__(self, *args, late_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs):
        if kwargs.get("description"):  # a module docstring's reST literals, plain in --help
            kwargs["description"] = kwargs["description"].replace("``", "")
        super().__init__(*args, **kwargs)
        self._late_arguments = late_arguments

    def _add_late_arguments(self) -> None:
        if self._late_arguments is not None:
            add, self._late_arguments = self._late_arguments, None
            add(self)

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, after adding the late arguments (once)."""
        self._add_late_arguments()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        """argparse's, after adding the late arguments (once), so that ``--help`` lists them."""
        self._add_late_arguments()
        return super().format_help()

    def error(self, message: str):
        """Print ``PROG: error: MESSAGE`` in one line (no usage block) and exit with EXIT_USAGE (2).
        """
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum`` (``_`` separators allowed), else the
    usage error "expected a whole number >= minimum" (one line, exit 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, "
                                             f"got {text!r}")
        return value
    return parse


def parse_or_code(parser: argparse.ArgumentParser,
                  argv: list[str] | None) -> argparse.Namespace | int:
    """``parser``'s arguments from ``argv``, or the exit code where parsing ended the
    command (0 after ``--help``, ``EXIT_USAGE`` after a one-line error): for a ``main``
    that returns its code rather than exiting."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def positive_number(text: str) -> float:
    """An argparse ``type``: a float > 0 (nan refused), else a one-line usage error."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:  # nan too
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def output_path(flag: str, text: str) -> Path:
    """The file path ``text`` given to ``flag`` (``--out``, ``--emit-toml``...), its folder
    made, checked before any work: ``ValueError`` naming the flag where it is a directory,
    its folder cannot be made or it cannot be written."""
    out = Path(text)
    if out.is_dir():
        raise ValueError(f"{flag} {text}: is a directory; give a file path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag} {text}: cannot create its folder ({exc.strerror})") from None
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ValueError(f"{flag} {text}: not writable")
    return out


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


def run_rank_and_exit(body: Callable[[], None], command: str = "shardwise") -> None:
    """Run ``body`` as one rank of torchrun's gang, then leave with ``os._exit``: 0 when it
    returned, 1 when it raised (a ``RunError`` as one line, anything else with its
    traceback), 2 for the user's error (``base.errors.user_error_line``: one line).
    ``launch.shutdown`` runs either way; ``os._exit`` skips gloo's abort at interpreter
    exit."""
    import os

    from shardwise import launch
    from shardwise.base.errors import RunError, user_error_line

    code = 0
    try:
        body()
    except BaseException as e:
        line = None if isinstance(e, (KeyboardInterrupt, SystemExit)) else user_error_line(e)
        if line is not None or isinstance(e, RunError):
            print(f"{command}: error: {line or e}", file=sys.stderr)
            code = EXIT_USAGE if line is not None else 1
        else:
            import traceback

            traceback.print_exc()
            code = 1
    finally:
        launch.shutdown(clean=code == 0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
