"""Two "nodes" on one machine: two torchrun agents on loopback meet by c10d rendezvous."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from shardwise.launch import free_port
from shardwise.training.metrics import read_metrics


def test_two_node_torchrun_on_loopback(corpus, tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    port = free_port()
    out = tmp_path / "run"
    cmd = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "shardwise-test",
           "-m", "shardwise", "train", "--config", "configs/tiny.toml", "--data", str(corpus),
           "--training.out_dir", str(out), "--training.threads", "1"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    nodes = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    logs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert any("dp=2" in log for log in logs)  # one job of two ranks, not two jobs of one
    train = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 7))
    assert (out / "checkpoints" / "step_000006").is_dir()
