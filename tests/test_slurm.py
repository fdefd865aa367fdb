"""``examples/slurm/train.sbatch`` under a real Slurm: munge, slurmctld and slurmd started on
this machine (``tests/slurm_cluster.py``, one node in a network namespace of its own).
Skipped with the reason where the packages (Debian: ``slurm-wlm munge``), root or
``ip netns`` are missing; ``make test`` installs nothing."""

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO
from shardwise.training.metrics import read_metrics
from slurm_cluster import requeue_cancel_resubmit, slurm_cluster, unavailable

SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
STEPS, EVERY = 150, 10  # steps enough, after two checkpoints, to be cancelled mid-run
RUN_TIMEOUT_S = 300.0


def job_args(corpus, out, log_dir, nodes=1, steps=STEPS):
    """sbatch options, script arguments and environment of the test's job: two tasks (two
    torchrun agents, one rank each) on ``nodes`` nodes, tiny config."""
    env = {"PYTHON": sys.executable, "OUT_DIR": str(out), "NPROC_PER_NODE": "1",
           "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    options = [f"--job-name=shardwise-test-{nodes}", f"--nodes={nodes}",
               f"--ntasks-per-node={2 // nodes}", "--cpus-per-task=1",
               f"--output={log_dir}/slurm-%j.out"]
    args = ["--config", "configs/tiny.toml", "--data", str(corpus),
            "--training.steps", str(steps), "--checkpoint.every", str(EVERY),
            "--training.sample_chars", "0"]
    return options, args, env


# Stand-ins for Slurm's commands, ``ip`` and the interpreter: the script's decisions, checked
# on any machine (the real cluster is the slow test below).
STUBS = {
    "scontrol": '''#!/bin/bash
case "$1 $2" in
  "show hostnames") printf '%s\\n' $STUB_NODES ;;
  "show node") echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1 NodeAddr=$STUB_NODEADDR Port=0" ;;
  *) exit 1 ;;
esac''',
    "srun": '''#!/bin/bash
echo "srun $*" | head -c 200 >> "$HOME/srun.log"; echo >> "$HOME/srun.log"
while [ $# -gt 0 ] && [[ $1 == --* ]]; do shift; done
if [ "$1" = test ]; then exit "${STUB_SHARED:-0}"; fi
exec "$@"''',
    "ip": '''#!/bin/bash
case "$*" in
  "-o -4 route get "*) echo "$5 via 10.1.2.1 dev eth7 src 10.1.2.77 uid 0 \\    cache" ;;
  "-o -4 addr show") echo "1: lo    inet 127.0.0.1/8 scope host lo"
                     echo "3: eth7    inet 10.1.2.77/24 brd 10.1.2.255 scope global eth7" ;;
esac''',
    "python": '''#!/bin/bash
echo "python $*"
echo "OMP_NUM_THREADS=${OMP_NUM_THREADS:-} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-}"''',
}


def _stubbed(tmp_path, nodes="n1 n2", node_addr="10.1.2.3", shared=0, **env):
    """Run the example as a 2-node job of id 4242 would, with ``STUBS`` on PATH."""
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    for name, text in STUBS.items():
        (stubs / name).write_text(text + "\n")
        (stubs / name).chmod(0o755)
    base = {"PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NUM_NODES": str(len(nodes.split())), "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NAME": "fit",
            "SLURM_SUBMIT_DIR": str(tmp_path), "STUB_NODES": nodes,
            "STUB_NODEADDR": node_addr, "STUB_SHARED": str(shared),
            "PYTHON": str(stubs / "python"), "HOME": str(tmp_path)}
    return subprocess.run(["bash", str(SBATCH), "--config", "x.toml"], cwd=tmp_path,
                          env=dict(base, **env), capture_output=True, text=True, timeout=60)


def test_sbatch_launches_one_agent_per_task_at_the_head_nodes_address(tmp_path):
    """Slurm's NodeAddr of the first node is the rendezvous endpoint, served by the first
    task there; the id and port come from the job id; each agent says its own address and
    has gloo use its interface; srun
    gets the CPUs per task (22.05+ no longer passes them on) and OpenMP their share."""
    done = _stubbed(tmp_path, SLURM_CPUS_PER_TASK="8", NPROC_PER_NODE="4",
                    SLURMD_NODENAME="n1", SLURM_LOCALID="0")
    assert done.returncode == 0, done.stderr
    assert f"head n1 at 10.1.2.3:29742, out_dir {tmp_path}/runs/fit" in done.stdout
    assert done.stdout.count("python -m torch.distributed.run --nnodes 2 --nproc-per-node 4 "
                             "--rdzv-backend c10d --rdzv-endpoint 10.1.2.3:29742 --rdzv-id "
                             "shardwise-4242-0 --rdzv-conf is_host=1 --max-restarts 0 "
                             "--local-addr 10.1.2.77 -m "
                             f"shardwise train --training.out_dir {tmp_path}/runs/fit "
                             "--config x.toml") == 1, done.stdout
    assert "OMP_NUM_THREADS=2 GLOO_SOCKET_IFNAME=eth7" in done.stdout, done.stdout
    steps = (tmp_path / "srun.log").read_text()
    assert "srun --ntasks=2 --kill-on-bad-exit=1 --cpus-per-task=8 bash -c" in steps, steps
    # the shared-storage probe ran on every node and left nothing behind
    assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1" in steps, steps
    assert not list((tmp_path / "runs" / "fit").iterdir())
    # a requeued job (same id) meets under a new rendezvous id; HEAD_ADDR overrides
    again = _stubbed(tmp_path, SLURM_RESTART_COUNT="1", HEAD_ADDR="10.9.9.9", RDZV_PORT="4000")
    assert "--rdzv-endpoint 10.9.9.9:4000 --rdzv-id shardwise-4242-1 " in again.stdout
    # the agent of another node (or a second one on the head node) is a client of the store
    assert "--rdzv-conf is_host=0 " in again.stdout
    second = _stubbed(tmp_path, SLURMD_NODENAME="n1", SLURM_LOCALID="1")
    assert "--rdzv-conf is_host=0 " in second.stdout


def test_sbatch_refuses_a_loopback_head_and_unshared_storage_in_one_line(tmp_path):
    """The head node's name resolving only to loopback (127.0.0.1 here; 127.0.1.1 under
    Debian's /etc/hosts) fails before any step when other nodes need to reach it; on one
    node loopback is right. An OUT_DIR a node cannot see fails too."""
    for addr in ("localhost", "127.0.1.1"):
        done = _stubbed(tmp_path, nodes="localhost n2", node_addr=addr)
        assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
        assert done.stderr.startswith("shardwise-slurm: error: head node localhost resolves "
                                      f"only to loopback (NodeAddr={addr}), which the other 1 "
                                      "node(s) cannot reach: set HEAD_ADDR"), done.stderr
        assert len(done.stderr.splitlines()) == 1, done.stderr
    one = _stubbed(tmp_path, nodes="localhost", node_addr="localhost", SLURM_NTASKS="1")
    assert one.returncode == 0 and "at 127.0.0.1:29742" in one.stdout, one.stderr
    assert "--local-addr" not in one.stdout  # one node: loopback is the right address
    unshared = _stubbed(tmp_path, shared=1)
    assert unshared.returncode == 2, unshared.stderr
    assert unshared.stderr.splitlines()[-1].startswith(
        f"shardwise-slurm: error: OUT_DIR={tmp_path}/runs/fit is not on storage every node "
        "shares"), unshared.stderr
    assert "--rdzv" not in unshared.stdout + unshared.stderr  # no training step launched
    outside = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, timeout=60,
                             env={"PATH": os.environ["PATH"]})
    assert (outside.returncode, outside.stderr) == (
        2, "shardwise-slurm: error: not inside a Slurm job: submit with sbatch\n")


def _train_steps(out):
    return [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]


@pytest.mark.slow  # 80-135 s on 2 shared cores: three attempts, each starting torch twice
def test_sbatch_trains_on_two_tasks_and_resumes_after_requeue_and_scancel(corpus, tmp_path):
    """The example submitted with two tasks trains one dp=2 job (the two agents meet by c10d
    rendezvous at the head node's address). Requeued by Slurm once a checkpoint exists, the
    job runs again under its id and resumes from it; cancelled with ``scancel`` after the
    next checkpoint and submitted again, the new job resumes from that one and finishes."""
    if (why := unavailable()) is not None:
        pytest.skip(why)
    out, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    options, args, env = job_args(corpus, out, logs)
    with slurm_cluster(cpus=2) as cluster:
        run = requeue_cancel_resubmit(cluster, SBATCH, options, args, env, out, logs,
                                      cwd=REPO, timeout=RUN_TIMEOUT_S)
        daemons = cluster.logs()
    log1, log2 = run.first_log, run.second_log
    assert run.first_state == "CANCELLED", log1
    assert EVERY <= run.requeued_at < run.saved < STEPS, (run.requeued_at, run.saved, log1)
    for restart in (0, 1):  # the requeued attempt appended to the same output
        assert f"job {run.first} (restart {restart}): 2 agent(s) x 1 rank(s) on 1 node(s), " \
               "head " in log1, log1
    assert "dp=2" in log1 and "shardwise: done" not in log1, log1  # one job, cut short
    assert _resumed(log1) == [_resumed_line(out, run.requeued_at)], log1
    assert run.second_state == "COMPLETED", f"{log2}\n{daemons}"
    assert _resumed(log2) == [_resumed_line(out, run.saved)], log2
    done = [ln for ln in log2.splitlines() if ln.startswith("shardwise: done")]
    assert len(done) == 1 and done[0].startswith(f"shardwise: done: {STEPS} steps"), log2
    # one row per step: each attempt's up to the checkpoint the next one resumed from
    assert _train_steps(out) == list(range(1, STEPS + 1))
    assert (out / "checkpoints" / f"step_{STEPS:06d}").is_dir()


def _resumed(log):
    return re.findall(r"shardwise: resumed from \S+ at step \d+", log)


def _resumed_line(out, step):
    return f"shardwise: resumed from {out / 'checkpoints' / f'step_{step:06d}'} at step {step}"


@pytest.mark.slow  # 17-35 s on 2 shared cores
def test_sbatch_trains_across_two_nodes_whose_names_resolve_to_loopback(corpus, tmp_path):
    """Two Slurm nodes (network namespaces joined by a veth pair, each slurmd at its own
    address), one task each: the agents meet at the head node's NodeAddr and train dp=2
    across them. This machine's host name resolves to 127.0.0.1 on both (its /etc/hosts),
    the trap: without each agent's ``--local-addr`` and ``GLOO_SOCKET_IFNAME``, torchrun
    would publish, and gloo listen on, loopback."""
    if (why := unavailable()) is not None:
        pytest.skip(why)
    out, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    options, args, env = job_args(corpus, out, logs, nodes=2, steps=2 * EVERY)
    with slurm_cluster(cpus=1, nodes=2) as cluster:
        job = cluster.sbatch(SBATCH, options, args, env, cwd=REPO)
        state = cluster.wait(job, ("COMPLETED",), timeout=RUN_TIMEOUT_S)
        cluster.wait_gone(job, timeout=60)
        head = cluster.nodes[0]
        log, daemons = (logs / f"slurm-{job}.out").read_text(), cluster.logs()
    assert state == "COMPLETED", f"{log}\n{daemons}"
    assert f"2 agent(s) x 1 rank(s) on 2 node(s), head {head.name} at {head.addr}:" in log, log
    assert "dp=2" in log, log
    done = [ln for ln in log.splitlines() if ln.startswith("shardwise: done")]
    assert len(done) == 1 and done[0].startswith(f"shardwise: done: {2 * EVERY} steps"), log
    assert _train_steps(out) == list(range(1, 2 * EVERY + 1))
    assert not list(out.glob(".slurm-shared-*"))  # the shared-storage probe cleaned up
