"""What every command shares: the exit code for bad input and an argparse parser whose
errors are one line."""

from __future__ import annotations

import argparse
import sys

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors print one line and exit with ``EXIT_USAGE``
    (argparse's default prints the usage too)."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
