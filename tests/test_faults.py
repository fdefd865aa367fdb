"""Faults: the launcher killed (SIGTERM, SIGKILL, Ctrl-C) leaves no rank alive; a rank killed
under --max-restarts (ours or torchrun's) ends in a finished run equal to an uninterrupted one."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from fault_workers import (
    alive,
    children_of,
    descendants_of,
    listening_sockets,
    raise_run_error,
    rank_sockets,
    where_am_i,
)
from shardwise import checkpoint, launch
from shardwise.training.metrics import read_metrics


def _train(corpus, out, *extra, **popen):
    cmd = [sys.executable, "-m", "shardwise", "train", "--config", "configs/tiny.toml",
           "--data", str(corpus), "--training.out_dir", str(out), "--training.threads", "1",
           "--training.sample_chars", "0", "--training.progress", "false", *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _last_step(metrics: Path) -> int:
    if not metrics.is_file():
        return 0
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.endswith("}")]
    return max((r["step"] for r in rows if r["kind"] == "train"), default=0)


def _wait_for_step(proc, metrics: Path, step: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        if _last_step(metrics) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s")


def _ranks(launcher_pid: int) -> list[int]:
    """The launcher's ranks: its children started by multiprocessing's ``spawn``, or the
    children of its fork server (``launch.START_METHOD``)."""
    out = []
    for pid in children_of(launcher_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            out.append(pid)
        elif b"multiprocessing.forkserver" in cmdline:
            out += children_of(pid)
    return out


def test_killing_the_launcher_leaves_no_rank(corpus, tmp_path):
    """Three dp=2 launchers at once (starting processes is the slow part here), ended by
    SIGTERM, SIGKILL and a SIGINT to the whole process group (what Ctrl-C in a terminal
    sends): 10 s later no rank of any of them is alive."""
    hows = ("SIGTERM", "SIGKILL", "SIGINT")
    # the SIGINT launcher starts with SIGINT ignored, as a shell's background job does
    # (POSIX): the launcher must handle it anyway (before, it ignored Ctrl-C then)
    ignore_int = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731
    procs = {how: _train(corpus, tmp_path / how, "--training.steps", "100000",
                         start_new_session=True,
                         preexec_fn=ignore_int if how == "SIGINT" else None) for how in hows}
    try:
        _stop_three(procs, hows, tmp_path)
    finally:  # a failed check leaves no launcher training behind
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _stop_three(procs: dict, hows: tuple, tmp_path) -> None:
    for how in hows:
        _wait_for_step(procs[how], tmp_path / how / "metrics.jsonl", 2)
    # every process a launcher started: its ranks, their fork server, the resource tracker
    children = {how: descendants_of(p.pid) for how, p in procs.items()}
    for how in hows:
        assert len(_ranks(procs[how].pid)) == 2, how
    os.kill(procs["SIGTERM"].pid, signal.SIGTERM)
    os.kill(procs["SIGKILL"].pid, signal.SIGKILL)
    os.killpg(procs["SIGINT"].pid, signal.SIGINT)  # launcher and ranks alike
    errs = {}
    for how, p in procs.items():
        try:
            errs[how] = p.communicate(timeout=90)[1]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the launcher stopped by {how} did not exit within 90 s; "
                                 f"ranks alive: {_ranks(p.pid)}") from None
    deadline = time.monotonic() + 10
    while any(alive(c) for cs in children.values() for c in cs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for how in hows:
        assert not [c for c in children[how] if alive(c)], f"a rank outlived its launcher ({how})"
    assert procs["SIGKILL"].returncode == -signal.SIGKILL
    for how, code in (("SIGTERM", 143), ("SIGINT", 130)):
        err = errs[how]
        assert procs[how].returncode == code, err[-2000:]
        assert err.strip().splitlines()[-1].startswith(f"shardwise: stopped by {how}: every rank ended")
        assert "Traceback" not in err and err.count("\n") <= 2, err[-2000:]


def test_run_errors_come_back_as_one_line_and_are_not_retried():
    """A ``RunError`` in a rank (a NaN loss, a refused checkpoint) reaches the launcher as one
    line marked fatal, which ``--max-restarts`` does not retry: it would fail again."""
    with pytest.raises(launch.WorkerError) as err:
        launch.spawn(raise_run_error, 2, threads=1)
    assert err.value.fatal
    assert "\n" not in str(err.value) and "training loss is nan at step 3" in str(err.value)


@pytest.mark.skipif(launch.START_METHOD != "forkserver", reason="no fork server here")
def test_ranks_fork_from_one_server_with_the_launchers_environment_and_output(capfd,
                                                                             monkeypatch):
    """Ranks fork from a fork server (torch imported once), which two ``spawn`` calls share;
    each rank sees the launcher's environment (a changed one starts a new server, so a rank
    sees what a spawned process would) and writes to the launcher's standard output and
    error of the moment, not the server's."""
    monkeypatch.setenv("SHARDWISE_TEST_MARK", "one")
    with capfd.disabled():  # a new server (the environment changed), on pytest's own stdout
        first = launch.spawn(where_am_i, 2, ("",), threads=1)  # (prints nothing)
    second = launch.spawn(where_am_i, 2, ("two",), threads=1)
    server = {r["ppid"] for r in first + second}
    assert len(server) == 1 and os.getpid() not in server
    assert [r["mark"] for r in first + second] == ["one"] * 4
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"rank {rank} stdout two" in out and f"rank {rank} stderr two" in err
    monkeypatch.setenv("SHARDWISE_TEST_MARK", "three")
    third = launch.spawn(where_am_i, 2, ("three",), threads=1)
    assert [r["mark"] for r in third] == ["three"] * 2
    assert {r["ppid"] for r in third}.isdisjoint(server)


def test_local_runs_listen_on_loopback_only():
    store = launch.loopback_store()
    assert ("127.0.0.1", store.port) in listening_sockets(os.getpid())
    assert all(addr == "127.0.0.1" for addr, port in listening_sockets(os.getpid())
               if port == store.port)
    del store
    results = launch.spawn(rank_sockets, 2, threads=1)  # the store, gloo's pairs: all loopback
    for r in results:
        assert r["sum"] == 2.0 and r["listening"]
        assert {addr for addr, _ in r["listening"]} == {"127.0.0.1"}, r["listening"]


def _torchrun(corpus, out, *extra):
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend",
           "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "shardwise",  # port 0: no race
           "train", "--config", "configs/tiny.toml", "--data", str(corpus), "--training.out_dir",
           str(out), "--training.threads", "1", "--training.sample_chars", "0",
           "--training.progress", "false", *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# the local launcher's restart in make test; torchrun's own (--max-restarts) in the slow set
# (torchrun starts a gang as tests/test_torchrun.py does; the resume path is the same)
@pytest.mark.parametrize("launcher", ["local", pytest.param("torchrun",
                                                            marks=pytest.mark.slow)])
def test_restarts_resume_to_the_uninterrupted_result(corpus, tmp_path, launcher):
    """A rank SIGKILLed mid-run, under ``shardwise train --max-restarts 1`` or under
    ``torchrun --max-restarts 1``: the run finishes with the uninterrupted run's parameters,
    and one metrics row per step (none duplicated by the restart)."""
    steps = 200
    args = ("--training.steps", str(steps), "--checkpoint.every", "30", "--checkpoint.keep",
            "2")
    straight = _train(corpus, tmp_path / "straight", *args)
    run = tmp_path / launcher
    proc = (_train(corpus, run, *args, "--max-restarts", "1") if launcher == "local"
            else _torchrun(corpus, run, *args))
    deadline, killed = time.monotonic() + 180, False
    while not killed and time.monotonic() < deadline:  # kill a rank at step >= 70
        if proc.poll() is not None:
            out = proc.communicate()
            raise AssertionError(f"{launcher} ended before a rank was killed: "
                                 f"{''.join(x or '' for x in out)[-3000:]}")
        if _last_step(run / "metrics.jsonl") >= 70:
            ranks = _ranks(proc.pid) if launcher == "local" else children_of(proc.pid)
            assert len(ranks) == 2
            os.kill(max(ranks), signal.SIGKILL)
            killed = True
        time.sleep(0.05)
    assert killed, f"{launcher} never reached step 70"
    if launcher == "local":
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert "restart 1 of 1" in err and "resumed from" in out, err[-3000:]
    else:
        log = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, log[-3000:]
        assert "resumed from" in log, log[-3000:]  # only a restarted gang finds a checkpoint
    assert straight.wait(timeout=300) == 0
    last = checkpoint.checkpoint_name(steps)
    final = {r: checkpoint.read_tensors(tmp_path / r / "checkpoints" / last, "model.")
             for r in ("straight", launcher)}
    assert final["straight"]
    assert final[launcher].keys() == final["straight"].keys()
    for name, t in final["straight"].items():
        assert torch.equal(final[launcher][name], t), (launcher, name)
    rows = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert rows == list(range(1, steps + 1)), launcher  # no duplicate rows after the restart


def test_the_fork_servers_quick_exit_is_only_the_servers():
    """``shardwise.base.fork_server`` (preloaded by the fork server, which then skips torch's
    teardown) changes nothing in any other process that imports it: the exit code stays."""
    code = "import shardwise.base.fork_server; raise SystemExit(3)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 3
