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
from slurm_cluster import cancel_and_resubmit, slurm_cluster, unavailable

SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
STEPS, EVERY = 80, 10  # enough steps left after the first checkpoint to cancel mid-run
RUN_TIMEOUT_S = 300.0


def job_args(corpus, out, log_dir):
    """sbatch options, script arguments and environment of the test's job: two tasks (two
    torchrun agents, one rank each) on the one node, tiny config."""
    env = {"PYTHON": sys.executable, "OUT_DIR": str(out), "NPROC_PER_NODE": "1",
           "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    options = ["--job-name=shardwise-test", "--nodes=1", "--ntasks-per-node=2",
               "--cpus-per-task=1", f"--output={log_dir}/slurm-%j.out"]
    args = ["--config", "configs/tiny.toml", "--data", str(corpus),
            "--training.steps", str(STEPS), "--checkpoint.every", str(EVERY),
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
    """Slurm's NodeAddr of the first node is the rendezvous endpoint; the id and port come
    from the job id; each agent says its own address and has gloo use its interface; srun
    gets the CPUs per task (22.05+ no longer passes them on) and OpenMP their share."""
    done = _stubbed(tmp_path, SLURM_CPUS_PER_TASK="8", NPROC_PER_NODE="4")
    assert done.returncode == 0, done.stderr
    assert f"head n1 at 10.1.2.3:29742, out_dir {tmp_path}/runs/fit" in done.stdout
    assert done.stdout.count("python -m torch.distributed.run --nnodes 2 --nproc-per-node 4 "
                             "--rdzv-backend c10d --rdzv-endpoint 10.1.2.3:29742 --rdzv-id "
                             "shardwise-4242-0 --max-restarts 0 --local-addr 10.1.2.77 -m "
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


@pytest.mark.slow  # ~80 s on 2 loaded cores: two jobs, each starting torch twice
def test_sbatch_trains_on_two_tasks_and_resumes_after_scancel(corpus, tmp_path):
    """The example submitted with two tasks trains one dp=2 job (the two agents meet by c10d
    rendezvous at the head node's address); ``scancel`` once a checkpoint exists, then the
    same ``sbatch`` again: the new job resumes from that checkpoint and finishes the run."""
    if (why := unavailable()) is not None:
        pytest.skip(why)
    out, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    options, args, env = job_args(corpus, out, logs)
    with slurm_cluster(cpus=2) as cluster:
        run = cancel_and_resubmit(cluster, SBATCH, options, args, env, out, logs, cwd=REPO,
                                  timeout=RUN_TIMEOUT_S)
        daemons = cluster.logs()
    log1, log2 = run.first_log, run.second_log
    assert run.first_state == "CANCELLED", log1
    assert EVERY <= run.saved < STEPS, (run.saved, log1)
    assert "2 agent(s) x 1 rank(s) on 1 node(s), head " in log1, log1
    assert "dp=2" in log1 and "shardwise: done" not in log1, log1  # one job, cut short
    assert run.second_state == "COMPLETED", f"{log2}\n{daemons}"
    resumed = re.findall(r"shardwise: resumed from (\S+) at step (\d+)", log2)
    assert resumed == [(str(out / "checkpoints" / f"step_{run.saved:06d}"), str(run.saved))], \
        (resumed, run.saved, log2)
    done = [ln for ln in log2.splitlines() if ln.startswith("shardwise: done")]
    assert len(done) == 1 and done[0].startswith(f"shardwise: done: {STEPS} steps"), log2
    # one row per step: the first job's up to the checkpoint, then the second job's
    assert _train_steps(out) == list(range(1, STEPS + 1))
    assert (out / "checkpoints" / f"step_{STEPS:06d}").is_dir()
