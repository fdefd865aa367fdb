"""The examples run as a user runs them, and still prove what they claim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_own_module_ddp_zero_tp_matches_one_process():
    """``examples/own_module_ddp_zero_tp.py``: a user's MLP under our DDP, ZeRO-2 and
    Megatron column/row layers on 2 gloo ranks equals the single-process run to 1e-5."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "own_module_ddp_zero_tp.py")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.findall(r"^(\w+)\s+max relative difference vs one process: "
                       r"loss (\S+), parameters (\S+)$", out.stdout, re.M)
    assert [way for way, _, _ in found] == ["ddp", "zero2", "tp"], out.stdout
    for way, loss, params in found:
        assert float(loss) <= 1e-5 and float(params) <= 1e-5, (way, loss, params)
    last, first = map(float, re.search(r"final loss (\S+), from (\S+)\)", out.stdout).groups())
    assert last < first, "the example must actually train"
