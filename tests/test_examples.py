"""The examples run as a user runs them, and still prove what they claim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers import assert_one_line_exit_2

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """``python ARGS`` in the repository, in an environment a user's shell might have (only
    PYTHONPATH and PATH: nothing of this test process leaks in, unlike
    ``helpers.run_shardwise``)."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})


def test_own_module_ddp_zero_tp_matches_one_process():
    """``examples/own_module_ddp_zero_tp.py``: a user's MLP under our DDP, ZeRO-2 and
    Megatron column/row layers on 2 gloo ranks equals the single-process run to 1e-5."""
    out = _run([str(ROOT / "examples" / "own_module_ddp_zero_tp.py")])
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.findall(r"^(\w+)\s+max relative difference vs one process: "
                       r"loss (\S+), parameters (\S+)$", out.stdout, re.M)
    assert [way for way, _, _ in found] == ["ddp", "zero2", "tp"], out.stdout
    for way, loss, params in found:
        assert float(loss) <= 1e-5 and float(params) <= 1e-5, (way, loss, params)
    last, first = map(float, re.search(r"final loss (\S+), from (\S+)\)", out.stdout).groups())
    assert last < first, "the example must actually train"


def test_own_decoder_at_2x2x2_matches_one_process():
    """``examples/own_decoder.py``: a decoder shardwise does not define (Meta names, parallel
    blocks, grouped-query attention, squared ReLU, untied head), registered with
    ``register_model`` and trained by the engine at dp=2 x pp=2 (1F1B) x tp=2 (sequence
    parallel) with ZeRO-1 on 8 gloo ranks, equals the same model in plain PyTorch in one
    process: every rank's losses and parameters within 1e-5 relative (fp32)."""
    out = _run([str(ROOT / "examples" / "own_decoder.py")])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FutureWarning" not in out.stderr, out.stderr  # a user's run reads clean
    steps = re.findall(r"^step (\d+)  loss (\S+)  \(one process: (\S+)\)$", out.stdout, re.M)
    assert [int(s) for s, _, _ in steps] == [1, 2, 3, 4, 5, 6], out.stdout
    loss, params = map(float, re.search(
        r"^max relative difference vs one process: loss (\S+), parameters (\S+) ",
        out.stdout, re.M).groups())
    assert loss <= 1e-5 and params <= 1e-5, (loss, params)
    first, last = float(steps[0][2]), float(steps[-1][2])
    assert last < first - 0.3, "the example must actually train"


def test_own_decoder_trains_from_the_cli_and_resumes(corpus, tmp_path):
    """``shardwise train --model.module examples/own_decoder.py --model.kind own-decoder``:
    the launcher and both ranks import the file, the [model] section becomes its config,
    and the run trains, checkpoints and resumes like the GPT's."""
    run = tmp_path / "run"
    argv = ["-m", "shardwise", "train", "--model.module", "examples/own_decoder.py",
            "--model.kind", "own-decoder", "--config", "configs/tiny.toml", "--data",
            str(corpus), "--model.n_kv_heads", "2", "--parallel.dp", "1", "--parallel.tp", "2",
            "--training.out_dir", str(run)]
    first = _run(argv + ["--training.steps", "3"])
    assert first.returncode == 0, first.stdout + first.stderr
    assert "shardwise: own-decoder 0.03M parameters" in first.stdout, first.stdout
    assert "done: 3 steps" in first.stdout and "sample:" in first.stdout
    second = _run(argv + ["--training.steps", "4"])
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from" in second.stdout and "at step 3" in second.stdout
    assert "done: 4 steps" in second.stdout


def test_bad_model_module_or_kind_is_one_line_and_exit_2(corpus, tmp_path, capsys, monkeypatch):
    """Each case: one line naming the field, exit code 2, and no rank started."""
    monkeypatch.chdir(ROOT)
    broken = tmp_path / "broken_model_file.py"
    broken.write_text("raise RuntimeError('boom at import')\n")
    mine = ["--model.module", "examples/own_decoder.py", "--model.kind", "own-decoder"]
    cases = [
        (["--model.module", "/no/such/model.py"], "model.module='/no/such/model.py': no such file"),
        (["--model.module", "no_such_model_module"],
         "model.module='no_such_model_module': cannot import it (ModuleNotFoundError: No module "
         "named 'no_such_model_module')"),
        (["--model.module", str(broken)], f"model.module={str(broken)!r}: cannot import it "
         "(RuntimeError: boom at import)"),
        (["--model.kind", "nonesuch"], "model.kind='nonesuch': not a registered model (gpt, "
         "llama"),
        (["--model.module", "examples/own_decoder.py", "--model.kind", "own_decoder"],
         "model.kind='own_decoder': not a registered model (gpt, llama, "),  # other tests
        # in this process may have registered kinds of their own after these
        (mine + ["--model.dropout", "0.1"], "model.dropout=0.1: own-decoder has no dropout"),
        (mine + ["--parallel.tp", "2"] + ["--model.n_kv_heads", "1"],
         "model.n_kv_heads (key/value heads)=1 is not divisible by parallel.tp=2"),
        (mine + ["--parallel.mode", "ps"], "model.kind='own-decoder' with parallel.mode=ps: "
         "the parameter server trains the GPT only"),
    ]
    out = tmp_path / "run"
    for extra, expected in cases:
        argv = ["train", "--config", "configs/tiny.toml", "--data", str(corpus),
                "--training.out_dir", str(out), *extra]
        assert_one_line_exit_2(argv, capsys, expected)
    assert not out.exists()
    assert "broken_model_file" not in sys.modules


def test_model_module_by_name_or_path_is_one_module(monkeypatch):
    """A module name on sys.path and the path of the same file import one module, once."""
    from shardwise.models import import_model_module, model_kinds

    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.delitem(sys.modules, "own_decoder", raising=False)
    by_name = import_model_module("own_decoder")
    assert import_model_module("examples/own_decoder.py") is by_name
    assert import_model_module("") is None
    assert model_kinds()[:2] == ("gpt", "llama") and "own-decoder" in model_kinds()
