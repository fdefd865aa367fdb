"""Hostile and mistaken inputs (issue 41): each is one line on stderr naming the field or
file, exit code 2, no traceback, and nothing created, moved or half-written (the directory
listing before and after). Refusals at the door run in this process; the launcher's own
path (an error inside a rank: a full disk) runs ``shardwise train`` as a user does.

One trained run (``trained``: configs/tiny.toml's model and batch, checkpoints at steps 2
and 4, metrics rows 1 to 6) is made once and copied per case."""

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from ddp_workers import tiny_config
from fault_workers import train_saving
from helpers import assert_one_line_exit_2, run_shardwise
from shardwise.base.config import Config
from shardwise.cli.main import main
from shardwise.training import rundir
from shardwise.training.metrics import read_metrics

TINY = str(REPO / "configs" / "tiny.toml")


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """A single-process run of configs/tiny.toml's model and global batch: 4 steps,
    checkpoints at 2 and 4, and metrics.jsonl rows for steps 1 to 6 (a run that went on
    past its last checkpoint: a resume drops rows 5 and 6)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    train_saving(tiny_config(str(corpus), str(out), training={"steps": 4,
                                                               "global_batch_size": 8}),
                 at=(2, 4))
    rows = [{"kind": "train", "step": s, "loss": 4.0 - 0.1 * s} for s in range(1, 7)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """This case's own copy of the trained run."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` (relative) with, for a file, its size and modification
    time (a directory's own time moves with the write probe of ``rundir.check_writable``)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (0, 0) if p.is_dir() else (st.st_size, st.st_mtime_ns)
    return out


def _train(corpus, out, *extra) -> list[str]:
    return ["train", "--config", TINY, "--data", str(corpus), "--training.out_dir", str(out),
            *extra]


def _no_metadata(run: Path, *steps: int) -> None:
    for s in steps:
        (run / "checkpoints" / f"step_{s:06d}" / ".metadata").unlink()


def _full_disk_on_replace(monkeypatch) -> None:
    """The rewrite of metrics.jsonl hits a full disk: its ``.tmp`` half written, then ENOSPC
    (the replace, as on a disk whose last blocks the ``.tmp`` took)."""
    from shardwise.base import files

    real = os.replace

    def replace(src, dst):
        if str(src).endswith("metrics.jsonl.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(src, dst)

    monkeypatch.setattr(files.os, "replace", replace)  # every whole-file write's rename


def _no_cuda(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


# (id, setup(run, monkeypatch) or None, extra arguments, what the one line names); a case
# with setup None runs on a fresh out_dir (it must stay absent), the others on a copy of
# the trained run (its listing must stay the same)
CASES = [
    # issue 41's defects
    ("global batch on resume", lambda run, mp: None,
     ["--training.global_batch_size", "16", "--training.steps", "9"],
     ["training.global_batch_size=8 there, 16 here", "step_000004"]),
    ("seed on resume", lambda run, mp: None, ["--training.seed", "7"],
     ["training.seed=1337 there, 7 here", "step_000004"]),
    ("every checkpoint without .metadata", lambda run, mp: _no_metadata(run, 2, 4), [],
     ["no usable checkpoint", "incomplete checkpoint", "step_000004 (no .metadata)"]),
    ("full disk rewriting metrics.jsonl", lambda run, mp: _full_disk_on_replace(mp), [],
     ["metrics.jsonl.tmp", "No space left on device (ENOSPC, errno 28)"]),
    ("cuda without a GPU", lambda run, mp: _no_cuda(mp),
     ["--training.device", "cuda", "--parallel.dp", "1"],
     ["training.device=cuda: CUDA is not available on this machine"]),
    # what the README and docs/config.md#refused-at-the-door promise
    ("misspelt key", None, ["--optimizer.lrr", "1e-3"],
     ["optimizer.lrr: unknown key; did you mean optimizer.lr?"]),
    ("wrong type", None, ["--training.steps", "many"],
     ["training.steps: Input should be a valid integer"]),
    ("batch not divisible", None, ["--training.global_batch_size", "30", "--parallel.dp", "4"],
     ["training.global_batch_size=30 must be divisible by parallel.dp x parallel.micro_batches"]),
    ("interleaved m", None, ["--parallel.pp", "2", "--parallel.schedule", "interleaved",
                             "--parallel.chunks_per_rank", "2", "--parallel.micro_batches", "3",
                             "--parallel.dp", "1", "--training.global_batch_size", "12"],
     ["parallel.micro_batches=3 must be a multiple of parallel.pp=2"]),
    ("fp8 on the CPU", None, ["--training.precision", "fp8"], ["training.precision=fp8 needs"]),
    ("pipedream with zero", None, ["--parallel.pp", "2", "--parallel.schedule", "pipedream",
                                   "--parallel.zero", "1"],
     ["parallel.schedule=pipedream with parallel.zero=1"]),
    ("selective recompute with pipedream", None,
     ["--parallel.pp", "2", "--parallel.schedule", "pipedream", "--optimizer.grad_clip", "0",
      "--parallel.recompute", "selective"],
     ["parallel.recompute=selective with parallel.schedule=pipedream"]),
    ("full recompute with a split backward", None,
     ["--parallel.pp", "2", "--parallel.schedule", "zb1p", "--parallel.recompute", "full"],
     ["parallel.schedule=zb1p with parallel.recompute=full"]),
    ("zero-3 with a split backward", None,
     ["--parallel.pp", "2", "--parallel.schedule", "zb1p", "--parallel.zero", "3"],
     ["parallel.schedule=zb1p with parallel.zero=3"]),
    ("ep without experts", None, ["--parallel.ep", "2"], ["parallel.ep=2 with model.n_experts=0"]),
    ("cp and block size", None, ["--parallel.cp", "3", "--parallel.dp", "1"],
     ["model.block_size=32 is not divisible by 2 x parallel.cp = 6"]),
    ("compile with tp and dropout", None, ["--training.compile", "true", "--parallel.tp", "2",
                                           "--model.dropout", "0.1"],
     ["training.compile with parallel.tp=2 and model.dropout=0.1"]),
    ("zero-3 with tied chunks", None, ["--parallel.zero", "3", "--parallel.chunks_per_rank", "2",
                                       "--parallel.schedule", "interleaved"],
     ["parallel.zero=3 with parallel.chunks_per_rank=2"]),
    ("resume with nothing", None, ["--resume"], ["--resume: no complete checkpoint"]),
    # a resume into what the checkpoint contradicts
    ("model shape on resume", lambda run, mp: None, ["--model.n_embd", "64"],
     ["cannot resume", "model.n_embd=32 there, 64 here"]),
    ("steps below the checkpoint", lambda run, mp: None, ["--training.steps", "3"],
     ["training.steps=3 is below step 4"]),
]


@pytest.mark.parametrize("setup, extra, needles", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(setup, extra, needles, corpus,
                                                         tmp_path, capsys, monkeypatch,
                                                         request):
    if setup is None:  # refused at the door, before any directory is made
        out = tmp_path / "fresh" / "run"
        assert_one_line_exit_2(_train(corpus, out, *extra), capsys, *needles)
        assert not (tmp_path / "fresh").exists()
        return
    run = request.getfixturevalue("run")
    setup(run, monkeypatch)
    before = _listing(run)
    assert_one_line_exit_2(_train(corpus, run, *extra), capsys, *needles)
    assert _listing(run) == before  # nothing created (no lock, no .tmp), moved or rewritten


def test_a_missing_metadata_is_named_and_the_previous_checkpoint_used(run, corpus):
    """The newest checkpoint's ``.metadata`` deleted: one line says so (as for a damaged
    one) and the run resumes from the one before; it used to resume from it silently."""
    _no_metadata(run, 4)
    cfg = Config.load(TINY, {"data.path": str(corpus), "training.out_dir": str(run)})
    plan = rundir.prepare(cfg, "auto")
    assert plan.resume_from == run / "checkpoints" / "step_000002"
    assert plan.notes == [f"skipping incomplete checkpoint {run / 'checkpoints' / 'step_000004'}"
                          " (no .metadata)"]


def test_a_start_removes_the_stale_tmp_a_dead_run_left(run, corpus):
    """A run killed while saving leaves ``step_N.tmp`` (and ``metrics.jsonl.tmp``); the
    next start holds the out_dir's lock, so no writer is alive: it removes them, one line
    each. A refused start removes nothing."""
    stale = run / "checkpoints" / "step_000005.tmp"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"\0" * 4096)
    (run / "metrics.jsonl.tmp").write_text('{"step": 1')
    before = _listing(run)
    bad = Config.load(TINY, {"data.path": str(corpus), "training.out_dir": str(run),
                             "training.global_batch_size": 16})
    with pytest.raises(rundir.RunDirError, match="global_batch_size"):
        rundir.prepare(bad, "auto")
    assert _listing(run) == before
    cfg = Config.load(TINY, {"data.path": str(corpus), "training.out_dir": str(run)})
    plan = rundir.prepare(cfg, "auto")
    assert not stale.exists() and not (run / "metrics.jsonl.tmp").exists()
    assert plan.resume_from == run / "checkpoints" / "step_000004"
    assert [n for n in plan.notes if n.startswith("removed ")] == [
        f"removed {run / 'metrics.jsonl.tmp'}, left by a run that died while writing it",
        f"removed {stale}, left by a run that died while writing it"]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_failed_save_removes_its_tmp_and_names_the_file_and_errno(corpus, tmp_path,
                                                                    monkeypatch):
    """A full disk in the middle of a checkpoint (DCP's files half written, then ENOSPC):
    one line naming the ``.tmp`` and the errno, the ``.tmp`` gone, the earlier checkpoint
    kept. The same for the metrics file: cut back to its last whole row."""
    from fault_workers import trainer_for
    from shardwise import checkpoint
    from shardwise.base.errors import StorageError, user_error_line
    from shardwise.training.metrics import MetricsLog

    cfg = tiny_config(str(corpus), str(tmp_path / "run"), training={"steps": 2})
    trainer = trainer_for(cfg)
    trainer.train_step()
    trainer.save_checkpoint()
    real = checkpoint._write

    def half_then_full(tensors, tmp, group):
        real(tensors, tmp, group)  # the files are there...
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # ...but not all of them

    monkeypatch.setattr(checkpoint, "_write", half_then_full)
    trainer.train_step()
    root = tmp_path / "run" / "checkpoints"
    with pytest.raises(StorageError) as e:
        trainer.save_checkpoint()
    assert str(e.value).startswith(f"cannot write checkpoint {root / 'step_000002.tmp'}: No "
                                   "space left on device (ENOSPC, errno 28); the step's .tmp "
                                   "was removed")
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]

    def archive_writer_on_a_full_disk(tensors, tmp, group):  # torch's zip writer's words
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")

    monkeypatch.setattr(checkpoint, "_write", archive_writer_on_a_full_disk)
    monkeypatch.setattr(checkpoint, "_free_bytes", lambda path: 4096)  # < the tensors' bytes
    with pytest.raises(StorageError, match=r"step_000002.tmp: No space left on device \(ENOSPC"):
        trainer.save_checkpoint()
    monkeypatch.setattr(checkpoint, "_free_bytes", lambda path: 1 << 40)  # room: not the disk
    with pytest.raises(RuntimeError, match="unexpected pos"):
        trainer.save_checkpoint()
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]
    full = tmp_path / "full.jsonl"
    full.symlink_to("/dev/full")  # every write: ENOSPC
    with pytest.raises(StorageError, match=r"full.jsonl: No space left on device \(ENOSPC"):
        MetricsLog(full).write({"step": 1})
    # what a rank raises is sorted by the launcher: the user's (exit 2) or a bug's
    assert user_error_line(OSError(errno.EACCES, "Permission denied", "/x/m.jsonl")) == \
        "cannot write /x/m.jsonl: Permission denied (EACCES, errno 13)"
    assert user_error_line(ValueError("a bug")) is None


@contextlib.contextmanager
def _signals_kept():
    """``shardwise train`` in this process installs SIGINT / SIGTERM handlers: put back
    pytest's after it."""
    kept = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in kept.items():
            signal.signal(s, handler)


def test_a_rank_error_is_one_line_with_its_traceback_in_the_out_dir(corpus, tmp_path,
                                                                   capsys, monkeypatch):
    """The launcher's side of a rank's failure: the user's error (``WorkerError.usage``)
    is one line, exit 2; a bug is exit 1 with its message; both keep the rank's traceback
    in ``out_dir/errors.log`` and say where it is."""
    from shardwise import launch

    failures = {
        "usage": launch.WorkerError("rank 1: cannot write /d/m.jsonl: No space left on device "
                                    "(ENOSPC, errno 28)", usage=True,
                                    traceback="Traceback (most recent call last):\nOSError\n"),
        "bug": launch.WorkerError("rank 0 failed:\nTraceback (most recent call last):\n"
                                  "ZeroDivisionError: division by zero",
                                  traceback="Traceback (most recent call last):\n"
                                  "ZeroDivisionError: division by zero\n")}
    for kind, error in failures.items():
        def spawn(*args, _error=error, **kwargs):
            raise _error

        out = tmp_path / kind  # (the raised error's frames hold the first one's lock)
        monkeypatch.setattr(launch, "spawn", spawn)
        with _signals_kept():
            code = main(_train(corpus, out, "--parallel.dp", "1"))
        err = capsys.readouterr().err.strip()
        log = out / "errors.log"
        if kind == "usage":
            assert code == 2 and len(err.splitlines()) == 1, err
            assert err == (f"shardwise: error: {error} (traceback in {log})")
        else:
            assert code == 1 and err.splitlines()[-1] == f"shardwise: traceback in {log}", err
        assert error.traceback in log.read_text()


def test_a_full_disk_inside_a_rank_is_one_line_from_the_launcher(corpus, tmp_path):
    """``metrics.jsonl`` on a device that is always full (a link to /dev/full): the rank's
    first metrics row fails with ENOSPC; the launcher prints one line naming the file and
    the errno, exit 2, the traceback in ``out_dir/errors.log``; nothing half-written."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to("/dev/full")
    proc = run_shardwise(*_train(corpus, out, "--parallel.dp", "1", "--training.threads", "1",
                                 "--training.progress", "false", "--training.sample_chars", "0"))
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err == (f"shardwise: error: rank 0: cannot write {out / 'metrics.jsonl'}: No space "
                   f"left on device (ENOSPC, errno 28) (traceback in {out / 'errors.log'})")
    assert "OSError: [Errno 28]" in (out / "errors.log").read_text()
    assert sorted(_listing(out)) == [".shardwise.lock", "checkpoints", "errors.log",
                                     "metrics.jsonl"]


@pytest.mark.slow  # two runs (30-60 s here); the cases above inject the same failures
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_real_full_disk_at_save_and_the_rerun(corpus, tmp_path):
    """``training.out_dir`` on a 900 KB tmpfs: the checkpoint of step 6 does not fit. One
    line naming its ``.tmp`` and ENOSPC, exit 2, the ``.tmp`` removed, step 3 kept, every
    metrics row whole. A rerun over a stale ``.tmp`` that fills the disk (a run killed
    while saving) removes it, rewrites metrics.jsonl and fails the same way, in one line."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=900k", "tmpfs", str(mnt)], check=True)
    try:
        out = mnt / "run"
        argv = _train(corpus, out, "--parallel.dp", "1", "--training.threads", "1",
                      "--training.progress", "false", "--training.sample_chars", "0")
        tmp6 = out / "checkpoints" / "step_000006.tmp"
        for attempt in ("first", "rerun"):
            proc = run_shardwise(*argv)
            err = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
            assert err[-1].startswith("shardwise: error: rank ") and err[-1].endswith(
                f"cannot write checkpoint {tmp6}: No space left on device (ENOSPC, errno 28); "
                "the step's .tmp was removed; the earlier checkpoints are kept (traceback in "
                f"{out / 'errors.log'})"), err
            assert not tmp6.exists() and (out / "checkpoints" / "step_000003").is_dir()
            assert not (out / "metrics.jsonl.tmp").exists()
            assert [r["step"] for r in read_metrics(out / "metrics.jsonl")
                    if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
            if attempt == "first":
                assert len(err) == 1, err
                stale = out / "checkpoints" / "step_000009.tmp"
                stale.mkdir()
                with contextlib.suppress(OSError), open(stale / "__0_0.distcp", "wb") as f:
                    while True:  # until the disk is full
                        f.write(b"\0" * 65536)
                        f.flush()
                (out / "metrics.jsonl.tmp").write_bytes(b"")
            else:
                assert err[:-1] == [
                    f"shardwise: removed {out / 'metrics.jsonl.tmp'}, left by a run that "
                    "died while writing it",
                    f"shardwise: removed {stale}, left by a run that died while writing it"]
                assert not stale.exists()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_memory_prices_the_configs_own_dtype(capsys):
    """``shardwise memory --config`` prices the config's training.precision (configs/tiny.toml:
    fp32, what the run itself reports), not bf16; --precision still overrides it."""
    from shardwise.cli.memory import main as memory_main

    tables = {}
    for flag in ([], ["--precision", "fp32"], ["--precision", "bf16"]):
        assert memory_main(["--config", TINY, "--dp", "2", "--stages", "0", *flag]) == 0
        tables[" ".join(flag)] = capsys.readouterr().out
    assert "fp32 compute" in tables[""] and tables[""] == tables["--precision fp32"]
    assert tables[""] != tables["--precision bf16"]
