"""Device choice before any rank starts: CUDA only with a GPU per local rank, one-line
errors and notes otherwise (no GPU is needed to test the decision)."""

import pytest

from conftest import REPO
from shardwise.cli.main import main
from shardwise.launch import DeviceError, pick_device


@pytest.mark.parametrize("requested, ranks, gpus, expected", [
    ("cpu", 2, 8, "cpu"),
    ("auto", 2, 0, "cpu"),
    ("auto", 2, 2, "cuda"),
    ("auto", 8, 8, "cuda"),
    ("cuda", 1, 1, "cuda"),
])
def test_pick_device(requested, ranks, gpus, expected):
    assert pick_device(requested, ranks, gpus)[0] == expected


def test_auto_with_too_few_gpus_says_why_in_one_line():
    kind, note = pick_device("auto", 2, 1)
    assert kind == "cpu" and "2 local ranks but 1 GPU" in note and "\n" not in note


def test_cuda_with_too_few_gpus_is_one_line_error():
    with pytest.raises(DeviceError, match=r"training.device=cuda: 2 local ranks but 1 GPU "
                                          r"\(NCCL refuses two ranks on one GPU\)"):
        pick_device("cuda", 2, 1)


def test_cli_refuses_cuda_without_gpus_before_spawning(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["train", "--config", str(REPO / "configs/tiny.toml"),
                 "--training.device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "training.device=cuda: CUDA is not available on this machine" in err
    assert "\n" not in err and "ranks per host" not in err
    assert main(["train", "--training.device", "tpu"]) == 2
    assert "training.device='tpu': expected auto, cpu or cuda" in capsys.readouterr().err


@pytest.mark.parametrize("requested, backend, ranks, gpus, expected", [
    ("cuda", "gloo", 8, 1, "cuda"),   # several ranks share the one GPU (test mode)
    ("auto", "gloo", 2, 2, "cpu"),    # gloo without asking for CUDA: the CPU
    ("cuda", "nccl", 2, 2, "cuda"),
])
def test_pick_device_with_a_backend(requested, backend, ranks, gpus, expected):
    assert pick_device(requested, ranks, gpus, backend=backend)[0] == expected


def test_sharing_a_gpu_needs_gloo_and_a_gpu():
    with pytest.raises(DeviceError, match=r"--parallel.backend gloo \(ranks share a GPU"):
        pick_device("cuda", 4, 1)  # NCCL: one line, naming the way out
    for backend in ("gloo", "nccl", "auto"):  # no GPU at all: said so, whatever the backend
        with pytest.raises(DeviceError, match="training.device=cuda: CUDA is not available"):
            pick_device("cuda", 4, 0, backend=backend)


_PROBE = """
import sys, torch, torch.cuda
calls = []
for name in ("is_available", "device_count", "init", "_lazy_init", "current_device",
             "set_device", "get_device_properties", "get_device_capability", "mem_get_info"):
    def wrap(*a, _name=name, _orig=getattr(torch.cuda, name), **k):
        calls.append(_name)
        return _orig(*a, **k)
    setattr(torch.cuda, name, wrap)
for module in sys.argv[1:]:
    __import__(module)
print(",".join(calls))
"""


def test_the_fork_servers_imports_ask_cuda_nothing():
    """The ranks fork from a server that imported ``launch.PRELOAD``; a server that had
    initialised CUDA (even by counting devices, which starts the driver) would hand every
    rank a CUDA it cannot use. torch's own import is not watched (the probe needs it)."""
    import subprocess
    import sys

    from shardwise.launch import PRELOAD

    out = subprocess.run([sys.executable, "-c", _PROBE, *PRELOAD], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.strip() == "", f"importing {PRELOAD} called torch.cuda: {out.strip()}"
