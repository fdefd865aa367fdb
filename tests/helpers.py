"""Helpers shared by the test modules and the rank functions of the ``*_workers.py``
modules (imported by bare name, ``from helpers import rel_err``: conftest puts tests/ on
``sys.path``, and spawned ranks inherit it). Kept light: no pytest, no conftest (a spawned
rank imports this module too), the CLI imported only where it is called."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Per-tensor relative error ``|a - b| / |b|`` (Frobenius norms, float64, on the CPU;
    ``|b|`` clamped at 1e-30 so that a zero reference does not divide by zero). fp32 sums
    in another order differ by ~1e-7 per element, and Adam turns that into relative noise on
    entries near zero, so an elementwise relative bound would be meaningless there; the
    tensor-level one is not. Either tensor may be on CUDA or require grad."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_shardwise(*args: str, cwd: Path | str | None = REPO, timeout: float = 300,
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m shardwise ARGS`` in a fresh interpreter, as a user runs it; returns the
    finished process (``check=False``: the caller asserts on ``returncode``), stdout and
    stderr captured as text.

    ``cwd``: where it runs, the repository by default (so that ``configs/tiny.toml`` and
    the like resolve); ``None``: the test's own working directory. ``timeout``: seconds
    before ``subprocess.TimeoutExpired``. ``env``: variables set over ``os.environ`` (for
    instance ``{"PYTHONPATH": str(REPO / "src")}``); ``PYTHONUNBUFFERED=1`` always, so that
    what a rank printed before a failure is not lost in a buffer."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "shardwise", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _assert_one_line(code: int, err: str, needles: Sequence[str], what) -> str:
    err = err.strip()
    assert code == 2, (what, code, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, (what, err)
    for needle in needles:
        assert needle in err, (what, needle, err)
    return err


def assert_one_line_exit_2(argv: list[str], capsys, *needles: str,
                           main: Callable[[list[str]], int] | None = None) -> str:
    """A bad input, in this process: ``main(argv)`` (``shardwise.cli.main.main`` unless
    another entry point is given) returns exit code 2 and writes exactly one non-empty line
    to stderr, with no traceback, holding every one of ``needles``. Returns that line
    (stripped) for further checks. ``capsys``: pytest's fixture (or ``capfd``), read after
    the call: what an earlier call left on stderr counts too (read it first to drop it)."""
    if main is None:
        from shardwise.cli.main import main as shardwise_main

        main = shardwise_main
    code = main(argv)
    return _assert_one_line(code, capsys.readouterr().err, needles, argv)


def assert_proc_one_line_exit_2(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The same for a finished ``run_shardwise`` (or any ``subprocess.run`` with text
    output): exit code 2, exactly one non-empty line on stderr, no traceback, every one of
    ``needles`` in it. Returns the line (stripped)."""
    return _assert_one_line(proc.returncode, proc.stderr, needles, proc.args)
