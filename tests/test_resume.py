"""Checkpoint and resume: an interrupted run continues exactly like an uninterrupted one."""

import torch

from ddp_workers import resume_and_finish, run_all, tiny_config, train, train_and_checkpoint
from shardwise import checkpoint
from shardwise.launch import spawn


def test_resume_matches_uninterrupted_run(corpus, tmp_path):
    full = tiny_config(str(corpus), str(tmp_path / "full"), parallel={"dp": 2},
                       training={"steps": 10})
    cut = tiny_config(str(corpus), str(tmp_path / "cut"), parallel={"dp": 2},
                      training={"steps": 10})
    # one spawn runs both in turn (each with its own groups); the resume below starts fresh
    straight, first = zip(*spawn(run_all, 2, ([(train, (full,)), (train_and_checkpoint, (cut, 5))],)))
    assert [c.name for c in checkpoint.complete_checkpoints(tmp_path / "cut" / "checkpoints")] \
        == ["step_000005"]
    second = spawn(resume_and_finish, 2, (cut,))  # fresh processes: nothing survives but files
    for rank in range(2):
        assert second[rank]["resumed_at"] == 5
        assert first[rank]["losses"] == straight[rank]["losses"][:5]
        assert second[rank]["losses"] == straight[rank]["losses"]  # bitwise: same ops, same order
        for name, p in straight[rank]["params"].items():
            assert torch.equal(second[rank]["params"][name], p), name


def test_incomplete_checkpoint_is_invisible(corpus, tmp_path):
    cfg = tiny_config(str(corpus), str(tmp_path), training={"steps": 4})
    train_and_checkpoint(cfg, 2)  # one process, no torch.distributed
    root = tmp_path / "checkpoints"
    assert checkpoint.latest_checkpoint(root).name == "step_000002"
    # a crash mid-save leaves only the temporary directory behind
    crashed = root / "step_000003.tmp"
    crashed.mkdir()
    (crashed / ".metadata").write_bytes(b"partial")
    assert checkpoint.latest_checkpoint(root).name == "step_000002"


def test_checkpoint_holds_no_pickled_objects(corpus, tmp_path):
    """Only tensors go through DCP; everything else is JSON, so loading never unpickles."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    cfg = tiny_config(str(corpus), str(tmp_path), training={"steps": 4})
    train_and_checkpoint(cfg, 1)
    path = checkpoint.latest_checkpoint(tmp_path / "checkpoints")
    md = FileSystemReader(str(path)).read_metadata()
    assert md.state_dict_metadata
    assert all(isinstance(v, TensorStorageMetadata) for v in md.state_dict_metadata.values())
    meta = checkpoint.read_meta(path)
    assert meta["step"] == 1 and meta["tokenizer"]["chars"] and meta["config"]["model"]["n_layer"] == 2
