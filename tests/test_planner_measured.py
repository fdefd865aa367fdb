"""The planner beside GPU measurements (issue 44): each row of
``benchmarks/planner_measured.py`` within its bound, from that script's own computation
(no timing, no GPU: the measurements are the repository's recorded rows and published
tables)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "planner_measured.py"


@pytest.fixture(scope="module")
def pm():
    spec = importlib.util.spec_from_file_location("planner_measured", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_measurements_within_ten_percent(pm):
    rows = pm.measured_rows()
    assert len(rows) == len(pm.MEASURED) >= 5
    for r in rows:  # step time
        assert abs(r["error"]) <= pm.BOUND, r
    # peak allocated memory: compiled blocks' saved tensors and the logits' gradient
    # (planner.memory.compiled_model, logits_grad_bytes); fp8's saving is not counted, so
    # its row is over-predicted (the side that fits)
    mem = [r["memory_error"] for r in rows if r["memory_error"] is not None]
    assert len(mem) == 3 and all(abs(e) <= pm.BOUND for e in mem), mem


def test_published_runs_within_fifteen_percent(pm):
    rows = pm.foundry_rows()
    predicted = [r for i, r in enumerate(rows) if not r["fitted"]]
    for i, r in enumerate(rows):  # every row in its bound but the recorded misses
        assert (abs(r["error"]) > pm.PUBLISHED_BOUND) == (i in pm.KNOWN_MISSES), (i, r)
    assert sum(abs(r["error"]) <= pm.PUBLISHED_BOUND for r in predicted) >= 3
    # ZeRO-3's exposed collectives are what brings the fitted row in (part of the price)
    fitted = rows[pm.FOUNDRY_FITTED]
    assert fitted["hidden_error"] > pm.PUBLISHED_BOUND >= abs(fitted["error"])


def test_fitted_constants_fewer_than_rows(pm):
    from shardwise.planner import hardware as hw

    fitted = set(pm.FITTED) | {"ZERO3_EXPOSED"}
    assert all(hasattr(hw, k) for k in fitted)
    rows = len(pm.MEASURED) + len(pm.FOUNDRY)
    assert len(fitted) < rows
