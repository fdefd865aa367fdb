"""Two "nodes" on one machine: two torchrun agents on loopback meet by c10d rendezvous."""

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from shardwise.launch import available_cores, free_port
from shardwise.training.metrics import read_metrics


def test_two_node_torchrun_on_loopback(corpus, tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    port = free_port()
    out = tmp_path / "run"
    cmd = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "shardwise-test",
           "-m", "shardwise", "train", "--config", "configs/tiny.toml", "--data", str(corpus),
           "--training.out_dir", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    nodes = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    logs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert any("dp=2" in log for log in logs)  # one job of two ranks, not two jobs of one
    # each agent's LOCAL_WORLD_SIZE is 1, but both ranks share this machine's cores
    threads = re.findall(r"(\d+ threads?) per rank", "".join(logs))
    share = max(1, available_cores() // 2)
    assert threads == [f"{share} thread{'s' if share > 1 else ''}"], threads
    done = [line for log in logs for line in log.splitlines() if line.startswith("shardwise: done")]
    assert len(done) == 1 and done[0].startswith("shardwise: done: 6 steps in "), done
    train = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 7))
    assert (out / "checkpoints" / "step_000006").is_dir()


def test_ranks_beyond_the_cores_get_one_thread_and_one_warning(monkeypatch, capsys):
    """``launch.share_cores`` (in ``init_distributed``): more ranks on this machine than its
    cores, each rank takes one torch thread and the machine's first rank prints one line."""
    import torch
    import torch.distributed as dist

    from shardwise import launch

    monkeypatch.setattr(launch, "available_cores", lambda: 1)
    before = torch.get_num_threads()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert launch.share_cores(launch.RankEnv(0, 0, 1, 3)) == 3
        assert torch.get_num_threads() == 1
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(before)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["shardwise: warning: 3 ranks on 1 core of this machine: they take turns "
                     "on the cores, so step times do not measure the layout"], lines
    assert launch.rank_title(5, {"dp": 1, "pp": 0, "cp": 0, "tp": 1}) == \
        "shardwise rank 5 (dp 1, tp 1, pp 0)"
