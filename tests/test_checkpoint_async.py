"""Asynchronous checkpoints (``checkpoint.async_save``): the same files as a synchronous
save, and never a checkpoint that looks complete before every byte is written."""

import json
import subprocess
import sys
import threading

import pytest
import torch

from ddp_workers import tiny_config
from reshard_workers import fit_worker
from shardwise import checkpoint
from shardwise.base.errors import StorageError
from shardwise.launch import spawn


def test_async_and_sync_checkpoints_are_identical(corpus, tmp_path):
    """dp=2 with ZeRO-1, a checkpoint every 2 of 6 steps (and at the end), written in a
    background thread or not: the same losses, and every checkpoint's tensors and meta
    equal."""
    cfgs = [tiny_config(str(corpus), str(tmp_path / mode), parallel={"dp": 2, "zero": 1},
                        training={"steps": 6},
                        checkpoint={"every": 2, "at_end": True, "keep": 3,
                                    "async_save": mode == "async"})
            for mode in ("sync", "async")]
    sync, async_ = zip(*spawn(fit_worker, 2, (cfgs,)))
    assert sync[0]["losses"] == async_[0]["losses"] and len(sync[0]["losses"]) == 6
    names = ["step_000002", "step_000004", "step_000006"]
    for mode in ("sync", "async"):
        done = checkpoint.complete_checkpoints(tmp_path / mode / "checkpoints")
        assert [d.name for d in done] == names, mode
        assert not list((tmp_path / mode / "checkpoints").glob("*.tmp"))
    for name in names:
        a = checkpoint.read_tensors(tmp_path / "sync" / "checkpoints" / name)
        b = checkpoint.read_tensors(tmp_path / "async" / "checkpoints" / name)
        assert a.keys() == b.keys() and any(k.endswith("exp_avg") for k in a)
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
        meta = [checkpoint.read_meta(tmp_path / m / "checkpoints" / name) for m in ("sync", "async")]
        for m in meta:  # the config differs only in out_dir and async_save
            m.pop("config")
        assert meta[0] == meta[1] and len(meta[1]["history"]) == int(name[-6:]), name


def _tensors():
    return {"model": {"w": torch.arange(6.0).view(2, 3)}, "optimizer": {"w": {"step": torch.tensor(1.0)}}}


def test_background_write_publishes_only_when_complete(tmp_path, monkeypatch):
    """While the writer thread is still writing, the step's directory is ``.tmp`` only and
    no reader sees a checkpoint; after it ends, the checkpoint verifies."""
    gate, real = threading.Event(), checkpoint._write

    def slow_write(*args):
        assert gate.wait(30)
        real(*args)

    monkeypatch.setattr(checkpoint, "_write", slow_write)
    pending = checkpoint.save_async(tmp_path, 7, _tensors(), {"step": 7})
    assert not pending.done()
    assert checkpoint.latest_checkpoint(tmp_path) is None
    assert checkpoint.find_resumable(tmp_path) == (None, [])
    assert [p.name for p in tmp_path.iterdir()] == ["step_000007.tmp"]
    gate.set()
    assert pending.wait() == tmp_path / "step_000007"
    assert checkpoint.find_resumable(tmp_path)[0] == tmp_path / "step_000007"
    assert torch.equal(checkpoint.read_tensors(pending.path)["model.w"], _tensors()["model"]["w"])


def test_background_write_failure_is_one_line_and_publishes_nothing(tmp_path, monkeypatch):
    def broken(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write", broken)
    pending = checkpoint.save_async(tmp_path, 3, _tensors(), {"step": 3})
    with pytest.raises(StorageError, match=r"step_000003.tmp: No space left on device "
                       r"\(ENOSPC, errno 28\)") as e:  # the user's to fix: exit 2 (issue 41)
        pending.wait()
    assert "\n" not in str(e.value) and checkpoint.latest_checkpoint(tmp_path) is None
    assert list(tmp_path.iterdir()) == []  # its .tmp removed


def test_process_killed_mid_write_leaves_no_checkpoint(tmp_path):
    """A process that ends (``os._exit``, as a killed rank) while its background write is
    under way leaves a ``.tmp`` directory, which no reader takes for a checkpoint."""
    script = f"""
import os, time, torch
from shardwise import checkpoint
checkpoint.save(r"{tmp_path}", 2, {{"w": torch.ones(3)}}, {{"step": 2}})  # a complete one
def slow(*a):
    time.sleep(60)
checkpoint._write = slow
p = checkpoint.save_async(r"{tmp_path}", 4, {{"w": torch.ones(3)}}, {{"step": 4}})
time.sleep(0.5)
print("writing", flush=True)
os._exit(1)
"""
    checkpoint_write = subprocess.run([sys.executable, "-c", script], capture_output=True,
                                      text=True, timeout=120)
    assert "writing" in checkpoint_write.stdout, checkpoint_write.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000004.tmp"]
    assert checkpoint.find_resumable(tmp_path) == (tmp_path / "step_000002", [])
    assert json.loads((tmp_path / "step_000002" / "meta.json").read_text()) == {"step": 2}


@pytest.mark.slow
def test_cli_async_checkpoints_then_resume_in_another_layout(corpus, tmp_path):
    """``shardwise train --checkpoint.async_save true`` (dp=2): every checkpoint complete
    and verified when the command returns; then the same directory resumes at dp=1 x tp=2
    (resuming is the default) and finishes. Two CLI runs: 25-80 s here, hence slow."""
    from test_cli import _shardwise

    out = tmp_path / "run"
    common = ["train", "--config", "configs/tiny.toml", "--data", str(corpus),
              "--training.out_dir", str(out), "--training.sample_chars", "0"]
    first = _shardwise(*common, "--checkpoint.async_save", "true", "--checkpoint.every", "2",
                       "--checkpoint.keep", "5")
    assert first.returncode == 0, first.stderr[-3000:]
    done = checkpoint.complete_checkpoints(out / "checkpoints")
    assert [d.name for d in done] == ["step_000002", "step_000004", "step_000006"]
    assert not list((out / "checkpoints").glob("*.tmp"))
    for d in done:
        checkpoint.verify(d)
    second = _shardwise(*common, "--training.steps", "8", "--parallel.dp", "1",
                        "--parallel.tp", "2")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "at step 6" in second.stdout
    assert "done: 8 steps" in second.stdout
