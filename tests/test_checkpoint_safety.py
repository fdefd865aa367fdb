"""Loading never runs code; damaged checkpoints are stepped over; non-finite values are never
saved; one live run per directory; --fresh keeps the old checkpoints."""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from ddp_workers import tiny_config
from fault_workers import train_saving, trainer_for
from helpers import assert_one_line_exit_2, assert_proc_one_line_exit_2, run_shardwise
from shardwise import checkpoint
from shardwise.base.config import Config
from shardwise.base.errors import CheckpointError, NonFiniteLossError
from shardwise.checkpoint.integrity import write_manifest
from shardwise.checkpoint.reader import safe_read_metadata
from shardwise.cli.main import main
from shardwise.training import rundir
from shardwise.training.metrics import read_metrics


class _Evil:
    """What an attacker pickles: unpickling it calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def saved(corpus, tmp_path):
    """A single-process run of 4 steps with checkpoints at steps 2 and 4."""
    cfg = tiny_config(str(corpus), str(tmp_path / "run"), training={"steps": 4})
    final = train_saving(cfg, at=(2, 4))
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == ["step_000002", "step_000004"]
    return cfg, root, final


def _craft(path, payload, marker):
    """Replace ``path/.metadata`` by ``payload`` and re-sign the manifest, so the checksums
    pass and only the unpickler stands between the file and os.system."""
    (path / ".metadata").write_bytes(payload)
    write_manifest(path)
    assert not marker.exists()


def _nested_payload(path, marker) -> bytes:
    md = safe_read_metadata((path / ".metadata").read_bytes(), "real")
    key = next(iter(md.state_dict_metadata))
    md.state_dict_metadata[key] = _Evil(marker)  # deep inside a genuine Metadata
    return pickle.dumps(md)


@pytest.mark.parametrize("where", ["top", "nested"])
def test_crafted_metadata_is_refused_and_runs_nothing(saved, tmp_path, where):
    cfg, root, _ = saved
    marker = tmp_path / "pwned"
    latest = root / "step_000004"
    payload = (pickle.dumps(_Evil(marker)) if where == "top" else _nested_payload(latest, marker))
    _craft(latest, payload, marker)
    trainer = trainer_for(cfg)
    with pytest.raises(checkpoint.UnsafeCheckpointError, match=r"refused to load.*posix\.system"):
        trainer.resume(latest)
    with pytest.raises(checkpoint.UnsafeCheckpointError):
        checkpoint.find_resumable(root)  # no silent fallback past a crafted file
    assert not marker.exists()


def test_cli_refuses_crafted_checkpoint_in_one_line(saved, corpus, tmp_path):
    cfg, root, _ = saved
    marker = tmp_path / "pwned"
    _craft(root / "step_000004", pickle.dumps(_Evil(marker)), marker)
    proc = run_shardwise("train", "--config", "configs/tiny.toml", "--data", str(corpus),
                         "--training.out_dir", str(tmp_path / "run"), "--parallel.dp", "1",
                         timeout=120)
    assert_proc_one_line_exit_2(proc, "refused to load")
    assert not marker.exists()


def test_metadata_pointing_outside_the_checkpoint_is_refused(saved):
    cfg, root, _ = saved
    latest = root / "step_000004"
    md = safe_read_metadata((latest / ".metadata").read_bytes(), "real")
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../../../etc/passwd"
    (latest / ".metadata").write_bytes(pickle.dumps(md))
    write_manifest(latest)
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="not a data file"):
        trainer_for(cfg).resume(latest)


def _plant_in_data_files(path, marker, sizes: dict | None = None) -> None:
    """Replace every data file of ``path`` by a pickle that would run ``touch marker`` (cut
    or repeated to ``sizes[name]`` bytes when given) and re-sign the manifest: only the
    loader stands between the file and os.system."""
    payload = pickle.dumps(_Evil(marker))
    for f in path.glob("*.distcp"):
        n = sizes[f.name] if sizes else len(payload)
        f.write_bytes((payload * (n // len(payload) + 1))[:n])
    write_manifest(path)


def test_pickle_in_a_data_file_is_refused_in_one_line_and_runs_nothing(saved, tmp_path,
                                                                         capsys):
    """A data file (``*.distcp``) replaced by a pickle, checksums re-signed: DCP's read was
    a traceback in generate, export and every rank. Now: a file shorter than the tensors
    .metadata places in it is refused at the door (and stepped over on resume); one of the
    same size is refused by the weights-only load, in one line; nothing runs."""
    cfg, root, _ = saved
    marker = tmp_path / "pwned"
    latest, previous = root / "step_000004", root / "step_000002"
    sizes = {f.name: f.stat().st_size for f in latest.glob("*.distcp")}
    _plant_in_data_files(latest, marker)
    for argv in (["generate", str(latest), "--prompt", "T", "--tokens", "2"],
                 ["export", str(latest), "--format", "hf", "--out", str(tmp_path / "hf")]):
        assert_one_line_exit_2(argv, capsys, "__0_0.distcp: holds", "places a tensor at bytes")
    assert checkpoint.find_resumable(root)[0] == previous  # damaged: the previous one
    _plant_in_data_files(latest, marker, sizes)
    for argv in (["generate", str(latest), "--prompt", "T", "--tokens", "2"],
                 ["export", str(latest), "--format", "hf", "--out", str(tmp_path / "hf")]):
        err = assert_one_line_exit_2(argv, capsys, "step_000004: ")
        # the weights-only unpickler refuses it (UnpicklingError), or stops on its bytes
        assert ("a data file holds something other than tensors (refused by "
                "torch.load(weights_only=True)" in err or "do not load into this model" in err)
    with pytest.raises(CheckpointError, match="step_000004: "):
        trainer_for(cfg).resume(latest)  # what a rank raises: one line (a RunError)
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_another_models_shapes_and_a_foreign_meta_are_one_line(saved, tmp_path, capsys):
    """Generating with a [model] size other than the checkpoint's (DCP's size mismatch was a
    traceback), and a meta.json that is JSON but no object (an AttributeError on resume)."""
    cfg, root, _ = saved
    latest = root / "step_000004"
    assert_one_line_exit_2(["generate", str(latest), "--prompt", "T", "--model.n_layer", "5"],
                           capsys, "model.n_layer=5: the checkpoint's model has model.n_layer=2")
    assert_one_line_exit_2(["generate", str(latest), "--prompt", "T", "--model.block_size",
                            "999"], capsys, "model.block_size=999: the checkpoint's model has")
    a_file = tmp_path / "a_file"  # an --out that cannot be created: a traceback before
    a_file.write_text("x")
    assert_one_line_exit_2(["export", str(latest), "--format", "hf", "--out",
                            str(a_file / "hf")], capsys, "a_file/hf: cannot create it")
    meta = json.loads((latest / "meta.json").read_text())
    (latest / "meta.json").write_text(json.dumps({**meta, "tokenizer": {"kind": "weird"}}))
    write_manifest(latest)  # each rank rebuilt the tokenizer from it: a traceback per rank
    assert_one_line_exit_2(["train", "--config", str(REPO / "configs" / "tiny.toml"), "--data",
                            cfg["data"]["path"], "--training.out_dir", cfg["training"]["out_dir"],
                            "--parallel.dp", "1", "--training.steps", "5", "--resume",
                            "--training.global_batch_size", "16"], capsys,  # the saved run's
                           "step_000004/meta.json: its tokenizer does not read")
    (latest / "meta.json").write_text("[1, 2]")
    write_manifest(latest)
    assert_one_line_exit_2(["export", str(latest), "--format", "hf", "--out",
                            str(tmp_path / "hf")], capsys,
                           "meta.json: not a readable checkpoint description (a JSON list")
    assert checkpoint.find_resumable(root)[0] == root / "step_000002"


@pytest.mark.parametrize("damage", ["overwrite", "truncate"])
def test_damaged_latest_falls_back_to_previous(saved, damage):
    cfg, root, final = saved
    data = next((root / "step_000004").glob("*.distcp"))
    if damage == "overwrite":  # 4 KiB of 0xff in the middle, size unchanged
        with open(data, "r+b") as f:
            f.seek(data.stat().st_size // 2)
            f.write(b"\xff" * 4096)
    else:
        os.truncate(data, data.stat().st_size // 3)
    with pytest.raises(checkpoint.IntegrityError):
        trainer_for(cfg).resume(root / "step_000004")
    path, skipped = checkpoint.find_resumable(root)
    assert path.name == "step_000002"
    assert len(skipped) == 1 and "\n" not in skipped[0] and data.name in skipped[0]
    assert skipped[0].startswith("damaged checkpoint ")
    assert ("SHA-256 differs" if damage == "overwrite" else "truncated") in skipped[0]
    trainer = trainer_for(cfg)
    trainer.resume(path)
    while trainer.step < 4:
        trainer.train_step()
    for name, p in trainer.engine.named_parameters():  # same as the run that saved it
        assert torch.equal(p, final[name]), name
    (root / "step_000002" / "checksums.json").unlink()  # e.g. written by an older shardwise
    assert checkpoint.find_resumable(root)[0] is None
    with pytest.raises(CheckpointError, match=r"no usable checkpoint .*step_000004.*--fresh"):
        rundir.prepare(Config.from_dict(cfg), "auto")  # never a silent start over them



def test_checksums_use_the_one_file_hash(tmp_path):
    """One sha256 of a file for checkpoints and token shards (``data.shards.sha256_file``):
    the checkpoint's manifest holds hashlib's digest, read in pieces of any size."""
    import hashlib

    from shardwise.checkpoint import integrity
    from shardwise.data import shards

    assert integrity.sha256_file is shards.sha256_file
    body = bytes(range(256)) * 41 + b"tail"  # 10,500 bytes: pieces end mid-file
    (tmp_path / "a.distcp").write_bytes(body)
    (tmp_path / "meta.json").write_bytes(b"{}")
    want = hashlib.sha256(body).hexdigest()
    assert shards.sha256_file(tmp_path / "a.distcp", chunk=1000) == want
    manifest = write_manifest(tmp_path)
    assert manifest["files"]["a.distcp"] == {"bytes": len(body), "sha256": want}
    assert manifest["files"]["meta.json"]["sha256"] == hashlib.sha256(b"{}").hexdigest()

def test_non_finite_weights_are_never_saved_and_stop_the_run(saved):
    cfg, root, _ = saved
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}
    trainer = trainer_for(dict(cfg, training=dict(cfg["training"], steps=6)))
    trainer.resume()
    with torch.no_grad():
        trainer.engine.named_parameters()[0][1][0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"refused to save step 4: non-finite values in model\."):
        trainer.save_checkpoint()
    with pytest.raises(NonFiniteLossError, match="training loss is nan at step 5"):
        trainer.fit()
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()} == before
    assert [p.name for p in root.iterdir()] == ["step_000002", "step_000004"] or \
        sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000004"]


def test_second_live_run_on_a_directory_is_refused(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    held = rundir.acquire_lock(out)  # as a live launcher holds it
    argv = ["train", "--config", "configs/tiny.toml", "--data", str(corpus),
            "--training.out_dir", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is in use by a live run (pid" in err
    held.close()
    # a holder killed with SIGKILL leaves no stale lock: the kernel drops flock locks
    code = (f"import sys; sys.path.insert(0, {str(REPO / 'src')!r}); from shardwise.training import rundir; "
            f"from pathlib import Path; held = rundir.acquire_lock(Path({str(out)!r})); "
            "print('locked', flush=True); import time; time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(rundir.RunDirError):
        rundir.acquire_lock(out)
    holder.kill()
    holder.wait()
    rundir.acquire_lock(out).close()


def test_resume_by_default_truncates_metrics_and_fresh_moves_aside(saved, tmp_path):
    cfg_dict, root, _ = saved
    cfg = Config.from_dict(dict(cfg_dict, training=dict(cfg_dict["training"], steps=8)))
    metrics = tmp_path / "run" / "metrics.jsonl"  # rows beyond the checkpoint: a crashed run
    metrics.write_text("".join(json.dumps({"kind": "train", "step": s}) + "\n" for s in range(1, 7)))
    plan = rundir.prepare(cfg, "auto")
    plan.lock.close()
    assert plan.resume_from.name == "step_000004"
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4]
    with pytest.raises(rundir.RunDirError, match="training.steps=3 is below step 4"):
        rundir.prepare(Config.from_dict(cfg_dict | {"training": dict(cfg_dict["training"],
                                                                     steps=3)}), "auto")
    small = dict(cfg_dict, model=dict(cfg_dict["model"], n_layer=3))
    with pytest.raises(rundir.RunDirError, match="model.n_layer=2 there, 3 here"):
        rundir.prepare(Config.from_dict(small), "auto")
    other = dict(cfg_dict, data={"path": str(tmp_path / "other.txt")})
    with pytest.raises(rundir.RunDirError, match="cannot resume .*: data.path="):
        rundir.prepare(Config.from_dict(other), "auto")
    files = sorted(p.relative_to(root) for p in root.rglob("*"))
    plan = rundir.prepare(cfg, "fresh")
    plan.lock.close()
    assert plan.resume_from is None and not root.exists() and not metrics.exists()
    (moved,) = (tmp_path / "run").glob("checkpoints.before-*")
    assert sorted(p.relative_to(moved) for p in moved.rglob("*")) == files  # nothing deleted
    assert len(list((tmp_path / "run").glob("metrics.before-*.jsonl"))) == 1
