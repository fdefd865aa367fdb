"""Per-step fault tolerance with torchft (training.fault_tolerance, comm.torchft_replicas):
replica groups as separate processes on loopback (tests/ft_workers.py), a lighthouse in the
test process; then across namespace hosts (tests/hosts.py)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ft_workers
from ft_workers import lighthouse_on, records, start_on
from conftest import REPO
from shardwise.training.fault_tolerance import Lighthouse

WORKER = str(REPO / "tests" / "ft_workers.py")
WAIT_S = 120  # bound of every wait on a replica process
ENV = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")


def listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp*) of the sockets listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                out.append(addr)
    return out


def start(replica: int, lighthouse: str, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, "--replica-id", str(replica),
                             "--lighthouse", lighthouse, "--out", str(out), *extra],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(procs: list[subprocess.Popen]) -> list[str]:
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=WAIT_S)[0])
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    return logs


def wait_for(condition, proc: subprocess.Popen) -> None:
    """Until ``condition()`` holds, ``proc`` ends or WAIT_S pass."""
    deadline = time.monotonic() + WAIT_S
    while not condition() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


def replay(recs: list[dict]) -> list[float]:
    """One process training the committed steps: the slots of the live replicas (the
    survivor is replica 0; with two live, both slots)."""
    return ft_workers.reference([(r["step"], [0, 1][:r["live"]]) for r in recs])


def test_the_lighthouse_and_the_manager_listen_on_loopback_only():
    """torchft's own defaults bind every interface (the lighthouse [::]:29510, the Manager's
    server [::]); a local run's bind 127.0.0.1."""
    from shardwise.base.config import FaultToleranceConfig
    from shardwise.training.fault_tolerance import FaultTolerantReplica

    with Lighthouse(min_replicas=1) as lh:
        port = int(lh.address.rsplit(":", 1)[1])
        assert lh.address.startswith("http://127.0.0.1:")
        assert listening(port) == ["0100007F"]  # 127.0.0.1, little-endian hex
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                           wait_for_workers=False)
        ft = FaultTolerantReplica(FaultToleranceConfig(lighthouse=lh.address),
                                  state_dict=dict, load_state_dict=lambda sd: None,
                                  device=torch.device("cpu"), store_addr="127.0.0.1",
                                  store_port=store.port, hostname="127.0.0.1",
                                  bind="127.0.0.1", log=lambda s: None)
        try:
            manager_port = int(ft.manager._manager.address().rsplit(":", 1)[1])
            assert listening(manager_port) == ["0100007F"]
        finally:
            ft.shutdown()


def test_two_replica_groups_average_like_one_process(tmp_path):
    """Two replica groups, every step committed by both with the gradient averaged across
    them: both hold bitwise-equal parameters at every step, equal to one process averaging
    the two slots' gradients."""
    with Lighthouse(min_replicas=2) as lh:
        outs = [tmp_path / f"r{i}.jsonl" for i in range(2)]
        procs = [start(i, lh.address, outs[i], "--steps", "6", "--min-replicas", "2")
                 for i in range(2)]
        logs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    r0, r1 = records(outs[0]), records(outs[1])
    assert [r["step"] for r in r0] == [r["step"] for r in r1] == list(range(6))
    assert all(r["live"] == 2 for r in r0 + r1)
    assert [r["digest"] for r in r0] == [r["digest"] for r in r1]
    torch.testing.assert_close(torch.tensor(r0[-1]["params"]), torch.tensor(replay(r0)),
                               rtol=1e-5, atol=1e-6)


def test_a_lost_replica_leaves_the_survivor_training_and_heals_on_return(tmp_path):
    """Replica 1 is SIGKILLed in its 3rd step (after its backward, before the average): the
    step in flight does not commit, replica 0 redoes it alone and keeps committing, each
    step once, with its own gradient; replica 1 started again joins at a step boundary,
    heals from replica 0 (parameters, optimizer state, step: no file read) and from then
    on both hold bitwise-equal parameters; every process ends."""
    out0, out1 = tmp_path / "r0.jsonl", tmp_path / "r1.jsonl"
    with Lighthouse(min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=1000) as lh:
        common = ["--steps", "4", "--step-sleep", "0.1", "--timeout-ms", "5000"]
        survivor = start(0, lh.address, out0, *common)
        wait_for(lambda: records(out0), survivor)  # replica 0 first: it is the survivor
        doomed = start(1, lh.address, out1, *common, "--die-after", "3")
        doomed_log = finish([doomed])[0]
        died = time.time()
        assert doomed.returncode == -9, doomed_log[-2000:]
        wait_for(lambda: any(r["live"] == 1 and r["t"] > died for r in records(out0)),
                 survivor)
        alone = len(records(out0))
        back = start(1, lh.address, out1, *common)
        logs = finish([survivor, back])
    assert [survivor.returncode, back.returncode] == [0, 0], "\n".join(x[-3000:] for x in logs)
    r0, r1 = records(out0), records(out1)
    steps = [r["step"] for r in r0]
    assert steps == list(range(len(steps))), "a step committed twice or skipped"
    assert any(r["live"] == 1 and r["t"] > died for r in r0[:alone]), "the survivor stopped"
    assert r0[-1]["live"] == 2 and r1[-1]["step"] == r0[-1]["step"]
    rejoined = [r for r in r1 if r["pid"] == back.pid]  # after the heal
    by_step = {r["step"]: r["digest"] for r in r0}
    assert rejoined and all(r["digest"] == by_step[r["step"]] for r in rejoined)
    assert "replica 1: healed from a live peer at step" in logs[1]
    torch.testing.assert_close(torch.tensor(r0[-1]["params"]), torch.tensor(replay(r0)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fault", ["host_killed",
                                   pytest.param("partition", marks=pytest.mark.slow)])
def test_a_lost_host_heals_across_namespace_hosts(fault, tmp_path):
    """Three hosts: the lighthouse on host2, a replica group on host0 and on host1. host1 is
    lost mid-run, either killed whole (SIGKILL to every process of its namespace, then its
    replica started again) or cut off (its link down 3 s, the same process going on): host0
    keeps committing alone, host1's replica heals from it and both end with bitwise-equal
    parameters; no process is left on any host."""
    from hosts import hosts

    out0, out1 = tmp_path / "r0.jsonl", tmp_path / "r1.jsonl"
    common = ["--steps", "4", "--step-sleep", "0.1", "--timeout-ms", "2000"]
    with hosts(3) as net:
        lighthouse = lighthouse_on(net, net[2])
        survivor = start_on(net, net[0], 0, lighthouse, out0, *common)
        wait_for(lambda: records(out0), survivor)
        second = start_on(net, net[1], 1, lighthouse, out1, *common, "--steps", "1000")
        wait_for(lambda: sum(r["live"] == 2 for r in records(out0)) >= 2, survivor)
        cut = time.time()
        if fault == "host_killed":
            net.kill_host(net[1])
        else:
            net.set_link(net[1], up=False)
        wait_for(lambda: any(r["live"] == 1 and r["t"] > cut for r in records(out0)), survivor)
        if fault == "host_killed":
            second = start_on(net, net[1], 1, lighthouse, out1, *common)
        else:
            net.set_link(net[1], up=True)
        logs = finish([survivor] if fault == "partition" else [survivor, second])
        if fault == "partition":  # host1's replica ran with --steps 1000: stop it now
            net.kill_host(net[1])
        assert [net.pids(h) for h in net.hosts[:2]] == [[], []]
    assert survivor.returncode == 0, logs[0][-3000:]
    r0, r1 = records(out0), records(out1)
    assert [r["step"] for r in r0] == list(range(len(r0)))
    assert any(r["live"] == 1 and r["t"] > cut for r in r0)
    assert r0[-1]["live"] == 2
    healed = [r for r in r1 if r["t"] > cut]
    by_step = {r["step"]: r["digest"] for r in r0}
    assert healed and all(r["digest"] == by_step[r["step"]] for r in healed if r["step"] in by_step)
    assert healed[0]["step"] in by_step


@pytest.mark.parametrize("overrides, message", [
    ({"fault_tolerance.replica_id": 2, "fault_tolerance.group_size": 2},
     "fault_tolerance.replica_id=2 must be below fault_tolerance.group_size=2"),
    ({"fault_tolerance.min_replica_size": 3, "fault_tolerance.group_size": 2},
     "fault_tolerance.min_replica_size=3 is more than fault_tolerance.group_size=2"),
    ({"fault_tolerance.enable": True}, "fault_tolerance.enable=true needs "
                                       "fault_tolerance.lighthouse (http://HOST:PORT)"),
])
def test_bad_fault_tolerance_fields_are_one_line(overrides, message):
    from shardwise.base.config import Config, ConfigError

    with pytest.raises(ConfigError) as err:
        Config.load(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


# -- replica groups as `shardwise train` jobs (apps.lm.trainer, engine, training.loop) ------
TINY = ["--config", "configs/tiny.toml", "--training.sample_chars", "0",
        "--training.progress", "false", "--checkpoint.every", "0", "--checkpoint.at_end", "true"]


def train(out: Path, corpus: Path, *extra: str, replica: int | None = None,
          lighthouse: str = "") -> subprocess.Popen:
    """``shardwise train`` on tiny.toml in a session of its own (killed whole with killpg);
    ``replica``: one of two replica groups of a torchft job."""
    ft = [] if replica is None else [
        "--fault_tolerance.enable", "true", "--fault_tolerance.replica_id", str(replica),
        "--fault_tolerance.group_size", "2", "--fault_tolerance.lighthouse", lighthouse,
        "--fault_tolerance.process_group_timeout_ms", "5000"]
    with open(out.with_suffix(".log"), "w") as log:  # what it prints: read while it runs
        return subprocess.Popen([sys.executable, "-m", "shardwise", "train", *TINY, "--data",
                                 str(corpus), "--training.out_dir", str(out), *ft, *extra],
                                cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)


def printed(out: Path) -> str:
    """What the job of ``out`` printed so far."""
    return out.with_suffix(".log").read_text()


def in_session(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a job started with ``start_new_session``)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def ended(procs: list[subprocess.Popen]) -> list[str]:
    """Each job's output once it ends (WAIT_S at most); every process of its session gone."""
    try:
        return finish(procs)
    finally:
        for p in procs:
            for _ in range(100):
                if not in_session(p.pid):
                    break
                os.killpg(p.pid, signal.SIGKILL)
                time.sleep(0.05)


@contextlib.contextmanager
def frozen(job: subprocess.Popen):
    """Every process of ``job`` stopped (SIGSTOP) inside the block, going on after it."""
    os.killpg(job.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(job.pid, signal.SIGCONT)


def losses(out: Path) -> dict[int, float]:
    """Step -> loss of the run's train rows so far (a line being written is left out)."""
    path, rows = out / "metrics.jsonl", []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def final_params(out: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The model tensors of the run's last checkpoint (DCP, read into one file)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from shardwise import checkpoint

    path = checkpoint.latest_checkpoint(out / "checkpoints")
    dcp_to_torch_save(path, tmp / f"{out.name}.pt")
    return torch.load(tmp / f"{out.name}.pt", weights_only=False)["model"]


@pytest.mark.parametrize("layout", [
    pytest.param(["--parallel.dp", "1"], id="dp1", marks=pytest.mark.slow),
    pytest.param(["--parallel.dp", "2", "--parallel.zero", "1"], id="dp2-zero1"),
    pytest.param(["--parallel.dp", "2"], id="dp2-zero0", marks=pytest.mark.slow),
    pytest.param(["--parallel.dp", "2", "--parallel.zero", "3"], id="dp2-zero3",
                 marks=pytest.mark.slow)])
def test_two_shardwise_train_jobs_as_replica_groups_equal_one_process(layout, corpus,
                                                                      tmp_path):
    """Two ``shardwise train`` jobs as the two replica groups of a torchft job, each training
    its half of the global batch: their parameters bitwise equal, and the mean of their
    losses and their parameters those of one process training the whole global batch."""
    steps = ["--training.steps", "4"]
    with Lighthouse(min_replicas=2) as lh:
        jobs = [train(tmp_path / f"r{i}", corpus, *layout, *steps,
                      "--fault_tolerance.min_replica_size", "2", replica=i,
                      lighthouse=lh.address) for i in range(2)]
        ref = train(tmp_path / "one", corpus, "--parallel.dp", "1", *steps)
        ended(jobs + [ref])
    logs = [printed(tmp_path / n) for n in ("r0", "r1", "one")]
    assert [p.returncode for p in jobs + [ref]] == [0, 0, 0], "\n".join(x[-3000:] for x in logs)
    two_halves_equal_one(tmp_path)


@pytest.mark.slow
def test_a_killed_shardwise_train_job_leaves_the_other_training_and_heals_on_restart(
        corpus, tmp_path):
    """Replica group 1 (a ``shardwise train`` job, dp2 ZeRO-1) SIGKILLed whole mid-run:
    replica group 0 goes on alone, each step committed once; group 1 started again joins at a
    step boundary, heals from group 0 (parameters, optimizer state, step, sampler position;
    no checkpoint read), and both finish the run with bitwise-equal parameters; no process
    is left. Alone, group 0 would end its run before a new job is up (~40 steps/s here): the
    jobs of group 1 run with min_replica_size 2 (alone, they redo their step until group 0
    joins), and group 0 is frozen (SIGSTOP) while group 1's second job starts."""
    n = 40
    steps = ["--training.steps", str(n), "--training.log_every", "1",
             "--parallel.dp", "2", "--parallel.zero", "1"]
    r0, r1, r1b = (tmp_path / x for x in ("r0", "r1", "r1b"))
    alone, waits = ["--fault_tolerance.min_replica_size", "1"], [
        "--fault_tolerance.min_replica_size", "2"]
    with Lighthouse(min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=2000) as lh:
        doomed = train(r1, corpus, *steps, *waits, replica=1, lighthouse=lh.address)
        wait_for(lambda: "rank 0 holds" in printed(r1), doomed)  # its Manager is up
        survivor = train(r0, corpus, *steps, *alone, replica=0, lighthouse=lh.address)
        wait_for(lambda: len(losses(r1)) >= 3, doomed)
        os.killpg(doomed.pid, signal.SIGKILL)  # every process of the job
        ended([doomed])
        died = max(losses(r1))
        wait_for(lambda: max(losses(r0), default=0) >= died + 5, survivor)  # alone
        with frozen(survivor):
            back = train(r1b, corpus, *steps, *waits, replica=1, lighthouse=lh.address)
            wait_for(lambda: "rank 0 holds" in printed(r1b), back)
        ended([survivor, back])
    logs = [printed(r0), printed(r1b)]
    assert [survivor.returncode, back.returncode] == [0, 0], "\n".join(x[-3000:] for x in logs)
    assert not in_session(survivor.pid) and not in_session(back.pid)
    assert "replica group lost: 1 of 2 replica groups live" in logs[0], logs[0][-3000:]
    healed = [ln for ln in logs[1].splitlines() if "healed from a live peer" in ln]
    assert len(healed) == 1, logs[1]
    assert "shardwise: replica 1: healed from a live peer at step" in healed[0]
    at = int(healed[0].split("at step ")[1].split()[0])
    assert at >= died + 5, "the survivor trained no step alone"
    assert sorted(losses(r0)) == list(range(1, n + 1))  # each step once
    assert sorted(losses(r1b)) == list(range(at + 1, n + 1))
    p0, p1 = (final_params(x, tmp_path) for x in (r0, r1b))
    assert all(torch.equal(p0[k], p1[k]) for k in p0)


@pytest.mark.parametrize("extra, message", [
    (["--parallel.dp", "2", "--parallel.dp_replicate", "2"],
     "fault_tolerance.enable with parallel.dp_replicate=2: each replica group is its own job"),
    (["--parallel.pp", "2", "--parallel.schedule", "pipedream", "--parallel.dp", "1",
      "--model.tie_weights", "false", "--optimizer.grad_clip", "0"],
     "fault_tolerance.enable with parallel.schedule=pipedream"),
    (["--parallel.mode", "ps"], "fault_tolerance.enable with the ps application"),
    (["--parallel.dp", "2", "--training.global_batch_size", "6"],
     "training.global_batch_size=6 must be divisible by fault_tolerance.group_size x "
     "parallel.dp x parallel.micro_batches = 2 x 2 x 1"),
])
def test_what_replica_groups_cannot_do_is_refused_at_the_door(extra, message, corpus, capsys,
                                                              tmp_path):
    """One line, exit 2, before any rank starts (no lighthouse needed to say it)."""
    from shardwise.cli.main import main

    code = main(["train", *TINY, "--data", str(corpus), "--training.out_dir", str(tmp_path),
                 "--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2",
                 "--fault_tolerance.lighthouse", "http://127.0.0.1:9", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "\n" not in err, err


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--parallel.dp", "1"],
                                    ["--parallel.dp", "1", "--parallel.tp", "2"]],
                         ids=["dp1", "tp2"])  # tp2: the heal carries DTensor slices
def test_a_replica_group_resumed_from_its_checkpoint_sets_the_step_the_others_heal_to(
        layout, corpus, tmp_path):
    """Checkpoints cover the loss of the whole job: replica group 0 trains 4 steps alone and
    saves; then it resumes from that checkpoint while group 1 starts fresh. torchft counts
    the checkpoint's step for group 0 (``FaultTolerantReplica.load_state_dict``), so group 1, behind, heals from it
    at step 4, and both end with bitwise-equal parameters (without the restored step both
    would count 0: no heal, two different models). torchft's count of the slots trained
    comes back from the checkpoint too: 4 (group 0 alone), then 6 and 8 with group 1, in
    both groups' rows (not saved: 10 and 12, the checkpoint's 4 steps counted as 2 slots
    each; before: 2 and 4)."""
    r0, r1 = tmp_path / "r0", tmp_path / "r1"
    common = [*layout, "--training.log_every", "1"]
    with Lighthouse(min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=2000) as lh:
        first = train(r0, corpus, *common, "--training.steps", "4", replica=0,
                      lighthouse=lh.address)
        ended([first])
        assert first.returncode == 0, printed(r0)[-3000:]
        fresh = train(r1, corpus, *common, "--training.steps", "6",
                      "--fault_tolerance.min_replica_size", "2", replica=1,
                      lighthouse=lh.address)
        wait_for(lambda: "rank 0 holds" in printed(r1), fresh)  # its Manager is up
        resumed = train(r0, corpus, *common, "--training.steps", "6", replica=0,
                        lighthouse=lh.address)
        ended([fresh, resumed])
    logs = [printed(r0), printed(r1)]
    assert [resumed.returncode, fresh.returncode] == [0, 0], "\n".join(x[-3000:] for x in logs)
    assert "resumed from" in logs[0] and "at step 4" in logs[0]
    assert "shardwise: replica 1: healed from a live peer at step 4" in logs[1], logs[1]
    assert sorted(losses(r1)) == [5, 6]
    assert [c for _, c in rows(r0).values()] == [1, 2, 3, 4, 6, 8]
    assert [c for _, c in rows(r1).values()] == [6, 8]
    p0, p1 = (final_params(x, tmp_path) for x in (r0, r1))
    assert all(torch.equal(p0[k], p1[k]) for k in p0)


def _hooked_groups(corpus, outs: list[Path], go: Path, hooks, *extra: str) -> list:
    """``len(outs)`` replica groups (``shardwise train`` under ``tests/ft_train.py``, dp1,
    ``hooks(i)`` its hooks), all in the first quorum (each Manager heartbeating before the
    ``go`` file), run to their end against one lighthouse; returns the ended jobs."""
    with Lighthouse(min_replicas=1, join_timeout_ms=4000, heartbeat_timeout_ms=5000) as lh:
        jobs = []
        for i, out in enumerate(outs):
            with open(out.with_suffix(".log"), "w") as log:
                jobs.append(subprocess.Popen(
                    [sys.executable, str(REPO / "tests" / "ft_train.py"), "--go", str(go),
                     *hooks(i), "--", "train", *TINY, "--data", str(corpus),
                     "--training.out_dir", str(out), "--parallel.dp", "1", *extra,
                     "--fault_tolerance.enable", "true", "--fault_tolerance.replica_id",
                     str(i), "--fault_tolerance.group_size", str(len(outs)),
                     "--fault_tolerance.lighthouse", lh.address,
                     "--fault_tolerance.process_group_timeout_ms", "10000"],
                    cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT, text=True,
                    start_new_session=True))
        for job, out in zip(jobs, outs):  # every Manager heartbeating: one first quorum
            wait_for(lambda: "rank 0 holds" in printed(out), job)
        go.touch()
        ended(jobs)
    return jobs


def test_replica_groups_writing_checkpoints_train_every_step_together(corpus, tmp_path):
    """No kill, three replica groups (``shardwise train`` jobs, dp1), 20 steps, a checkpoint
    at step 10 that group 2 writes 6 s slower (a slow disk, ``tests/ft_train.py``), more than
    the lighthouse's ``join_timeout_ms`` (4000: a margin for a loaded machine's stalls
    between two steps): each group joins the next step's quorum
    before it writes, so no quorum goes on without a writing group: every group trains
    every step, once, in one quorum of three (no "lost" or "healed" line), and all end
    bitwise equal. Before (a checkpoint written between two steps), the two fast groups
    formed step 11's quorum without group 2, which then healed from them: its slot of the
    steps in between untrained (the soak's finding, docs/reliability.md)."""
    n = 20
    outs = [tmp_path / f"r{i}" for i in range(3)]
    jobs = _hooked_groups(
        corpus, outs, tmp_path / "go",
        lambda i: ["--slow-save", "6" if i == 2 else "0", "--slow-below", str(n)],
        "--training.steps", str(n), "--training.log_every", "1", "--checkpoint.every", "10",
        "--training.global_batch_size", "6")
    logs = [printed(out) for out in outs]
    assert [j.returncode for j in jobs] == [0, 0, 0], "\n".join(x[-3000:] for x in logs)
    for i, log in enumerate(logs):
        quorum = [ln for ln in log.splitlines() if "replica groups live" in ln]
        assert quorum == [f"shardwise: replica {i}: step 0: 3 of 3 replica groups live"], log
        assert "healed" not in log and "not committed" not in log, log
        assert sorted(losses(outs[i])) == list(range(1, n + 1))
    p = [final_params(out, tmp_path) for out in outs]
    assert all(torch.equal(p[0][k], q[k]) for q in p[1:] for k in p[0])


def test_replica_groups_that_differ_at_a_new_quorum_are_averaged(corpus, tmp_path):
    """Two replica groups, group 1 started from other weights (every parameter + 1e-3,
    ``tests/ft_train.py --perturb``): at the first quorum each group compares its state with
    the other's (one sum per tensor, ``TorchftReplicas.agree``), finds it differs, says so in
    one line and takes the mean of the two; both then train as one and end bitwise equal.
    Before, nothing compared them (torchft's step-0 sync is off: ``init_sync=False``) and
    they trained apart for ever at the same step count: the soak's split quorum
    (docs/reliability.md) left them so too."""
    outs = [tmp_path / f"r{i}" for i in range(2)]
    jobs = _hooked_groups(corpus, outs, tmp_path / "go",
                          lambda i: ["--perturb", "0.001" if i == 1 else "0"],
                          "--training.steps", "4", "--training.global_batch_size", "4")
    logs = [printed(out) for out in outs]
    assert [j.returncode for j in jobs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    for i, log in enumerate(logs):
        said = [ln for ln in log.splitlines() if "differed" in ln]
        assert said == [f"shardwise: replica {i}: step 0: its state differed from the other "
                        "live replica groups'; parameters and optimizer state averaged over "
                        "the 2 live groups"], log
    p = [final_params(out, tmp_path) for out in outs]
    assert all(torch.equal(p[0][k], p[1][k]) for k in p[0])


def two_halves_equal_one(tmp_path: Path) -> None:
    """Replica groups r0 and r1 (4 steps, each half of the batch) against "one" (one
    process, the whole batch): their mean loss is one's at each step, their parameters
    bitwise equal to each other and equal to one's (1e-5)."""
    r0, r1, one = (losses(tmp_path / n) for n in ("r0", "r1", "one"))
    assert sorted(r0) == sorted(r1) == sorted(one) == [1, 2, 3, 4]
    assert r0 != r1  # two halves of the batch
    torch.testing.assert_close(torch.tensor([(r0[s] + r1[s]) / 2 for s in one]),
                               torch.tensor(list(one.values())), rtol=1e-5, atol=1e-6)
    p0, p1, p = (final_params(tmp_path / n, tmp_path) for n in ("r0", "r1", "one"))
    assert sorted(p0) == sorted(p) and all(torch.equal(p0[k], p1[k]) for k in p0)
    for k in p:
        torch.testing.assert_close(p0[k], p[k], rtol=1e-5, atol=1e-6)


def rows(out: Path) -> dict[int, tuple[float, int]]:
    """Step -> (loss, batches_committed) of a replica group's train rows."""
    path = out / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: (r["loss"], r["batches_committed"]) for r in recs if r["kind"] == "train"}


@pytest.mark.slow
def test_a_whole_job_resumed_from_its_checkpoints_counts_on_as_an_uninterrupted_one(
        corpus, tmp_path):
    """Two replica groups train 6 steps (a checkpoint at step 3); the same job whose last
    checkpoint is step 3's (``checkpoint.at_end`` false) started again from it: each group's
    losses, torchft's count of the slots trained (``batches_committed``, a train row's field,
    saved in the checkpoint with torchft's step) and final parameters equal the uninterrupted
    run's, bit for bit (before, a resumed Manager counted from 0; a count that only the saved
    counters get right: the test below)."""
    common = ["--parallel.dp", "1", "--training.log_every", "1", "--training.steps", "6",
              "--checkpoint.every", "3", "--fault_tolerance.min_replica_size", "2"]

    def job(lh, name: str, at_end: str) -> list[subprocess.Popen]:
        return [train(tmp_path / f"{name}{i}", corpus, *common, "--checkpoint.at_end", at_end,
                      replica=i, lighthouse=lh.address) for i in range(2)]

    with Lighthouse(min_replicas=2) as whole, Lighthouse(min_replicas=2) as parts:
        jobs = job(whole, "u", "true") + job(parts, "i", "false")  # i: step 3's checkpoint
        ended(jobs)
        jobs += job(parts, "i", "true")  # resumed from step 3
        ended(jobs[4:])
    logs = [printed(tmp_path / n) for n in ("u0", "u1", "i0", "i1")]
    assert [j.returncode for j in jobs] == [0] * 6, "\n".join(x[-3000:] for x in logs)
    assert all("resumed from" in log and "at step 3" in log for log in logs[2:]), logs[2:]
    for r in range(2):
        whole_rows, resumed = rows(tmp_path / f"u{r}"), rows(tmp_path / f"i{r}")
        assert [c for _, c in whole_rows.values()] == [2, 4, 6, 8, 10, 12]
        assert resumed == whole_rows
        p, q = (final_params(tmp_path / f"{x}{r}", tmp_path) for x in "ui")
        assert all(torch.equal(p[k], q[k]) for k in p)


@pytest.mark.slow
def test_replica_groups_under_torchrun_across_namespace_hosts_equal_one_process(
        corpus, tmp_path):
    """Three namespace hosts: torchft's lighthouse on host2, and on host0 and host1 one
    replica group each, ``torchrun --nnodes 1 --nproc-per-node 2 -m shardwise train``
    (dp2 ZeRO-1 inside the group, the Manager's store on the group's rank 0, reached by the
    other group at its host's address): both groups' parameters bitwise equal, the mean of
    their losses and their parameters those of one process training the global batch; no
    process left on any host."""
    from hosts import hosts

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO / "src"))
    for var in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):  # each host its own
        env.pop(var, None)
    steps = ["--training.steps", "4", "--training.threads", "1"]
    with hosts(3) as net:  # first: it skips where namespaces cannot be made
        lighthouse = lighthouse_on(net, net[2])
        groups = []
        for i in range(2):
            with open(tmp_path / f"r{i}.log", "w") as log:
                groups.append(net.popen(net[i], [
                    torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend",
                    "c10d", "--rdzv-endpoint", f"{net[i].addr}:29400", "--rdzv-id",
                    f"group{i}", "-m", "shardwise", "train", *TINY, "--data", str(corpus),
                    "--training.out_dir", str(tmp_path / f"r{i}"), "--parallel.dp", "2",
                    "--parallel.zero", "1", *steps, "--fault_tolerance.enable", "true",
                    "--fault_tolerance.replica_id", str(i), "--fault_tolerance.group_size",
                    "2", "--fault_tolerance.min_replica_size", "2",
                    "--fault_tolerance.lighthouse", lighthouse], cwd=REPO, env=env,
                    stdout=log, stderr=subprocess.STDOUT))
        ref = train(tmp_path / "one", corpus, "--parallel.dp", "1", *steps)
        ended([ref])
        for g in groups:  # one left running is killed with its host on the way out
            with contextlib.suppress(subprocess.TimeoutExpired):
                g.wait(timeout=3 * WAIT_S)
        logs = [printed(tmp_path / n) for n in ("r0", "r1", "one")]
        assert [net.pids(h) for h in net.hosts[:2]] == [[], []]  # no rank or agent left
    assert [g.returncode for g in groups] + [ref.returncode] == [0, 0, 0], \
        "\n".join(x[-3000:] for x in logs)
    two_halves_equal_one(tmp_path)
