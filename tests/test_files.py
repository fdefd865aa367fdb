"""``base.files.replacing``: a file is replaced whole or keeps what it held, and no
temporary file outlives a failure."""

import os

import pytest

from shardwise.base import files


def test_replaced_whole_with_no_temporary_left(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")
    with files.replacing(path) as tmp:
        assert tmp == tmp_path / "a.json.tmp"
        tmp.write_text("new")
        assert path.read_text() == "old"  # a reader sees the old file until the rename
    assert path.read_text() == "new" and sorted(os.listdir(tmp_path)) == ["a.json"]


@pytest.mark.parametrize("unique", [False, True])
@pytest.mark.parametrize("where", ["write", "rename"])
def test_a_failure_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch,
                                                                 unique, where):
    path = tmp_path / "a.json"
    path.write_text("old")
    if where == "rename":
        def full(src, dst):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(files.os, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        with files.replacing(path, unique=unique) as tmp:
            tmp.write_text("half")
            if where == "write":
                raise OSError(28, "No space left on device")
    assert path.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["a.json"]


def test_unique_temporaries_do_not_collide_and_get_open_s_permissions(tmp_path):
    path = tmp_path / "peak.json"
    umask = os.umask(0o022)
    try:
        with files.replacing(path, unique=True) as a, files.replacing(path, unique=True) as b:
            assert a != b and a.parent == b.parent == tmp_path
            assert a.name.startswith(".peak.json.") and a.name.endswith(".tmp")
            assert (a.stat().st_mode & 0o777) == 0o644
            a.write_text("first")
            b.write_text("second")
    finally:
        os.umask(umask)
    assert path.read_text() == "first" and sorted(os.listdir(tmp_path)) == ["peak.json"]


def test_durable_syncs_the_file_and_its_folder(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(files.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    with files.replacing(tmp_path / "manifest.json", durable=True) as tmp:
        tmp.write_text("{}")
    assert len(synced) == 2  # the file before the rename, the folder after
    with files.replacing(tmp_path / "other.json") as tmp:
        tmp.write_text("{}")
    assert len(synced) == 2


def test_the_loss_plot_and_the_safetensors_leave_no_temporary_on_a_full_disk(tmp_path,
                                                                             monkeypatch):
    """Two writers that left their ``.tmp`` behind when the rename failed, before they
    went through ``replacing``."""
    import json

    import torch

    from shardwise.checkpoint.hf import write_safetensors
    from shardwise.training.metrics import plot_loss

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 4 - s / 10})
                               + "\n" for s in range(1, 4)))
    out = tmp_path / "hf"
    out.mkdir()

    def full(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(files.os, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        plot_loss(metrics, tmp_path / "loss.png", unit="char")
    with pytest.raises(OSError, match="No space left"):
        write_safetensors(out, {"w": torch.zeros(2, 2)})
    assert sorted(os.listdir(tmp_path)) == ["hf", "metrics.jsonl"] and not os.listdir(out)
