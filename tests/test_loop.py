"""The shared training loop as pure logic (no ranks): cadence of rows, evaluations and
checkpoints; the non-finite stop saves nothing of its step; the registry picks the app."""

import json

import pytest

from shardwise.base.config import Config
from shardwise.base.errors import NonFiniteLossError
from shardwise.training.loop import Cadence, TrainTask, run_loop


class Counting(TrainTask):
    """Loss 1/step (``nan_at``: NaN at that step); records evaluations and saves."""

    def __init__(self, cfg, nan_at=None):
        self.cfg, self.cadence, self.nan_at = cfg, Cadence.from_config(cfg), nan_at
        self.samples_per_step, self.sample_unit = 8, "images"
        self.saved, self.evaluated = [], []

    def train_step(self, sync=True):
        self.step += 1
        loss = float("nan") if self.step == self.nan_at else 1.0 / self.step
        self.record_loss(loss)
        return {"loss": loss}

    def evaluate(self):
        self.evaluated.append(self.step)
        return {"val_loss": 0.5}

    def save_checkpoint(self):
        self.saved.append(self.step)


def _cfg(tmp_path, **training):
    return Config.load(overrides={"training.out_dir": str(tmp_path), "training.progress": False,
                                  "training.steps": 10, "training.log_every": 4,
                                  "training.eval_every": 5, "checkpoint.every": 3,
                                  **{f"training.{k}": v for k, v in training.items()}})


def test_cadence_rows_and_summary(tmp_path):
    task = Counting(_cfg(tmp_path))
    out = run_loop(task)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [4, 8, 10]
    assert [r["step"] for r in rows if r["kind"] == "val"] == [5, 10]
    assert task.saved == [3, 6, 9, 10] and task.evaluated == [5, 10]
    train = [r for r in rows if r["kind"] == "train"]
    assert all(r["images_per_s"] > 0 and r["mfu"] is None for r in train)  # no FLOPs counted
    assert out["step"] == 10 and out["loss"] == pytest.approx(0.1) and out["val_loss"] == 0.5
    assert task.history == pytest.approx([1 / s for s in range(1, 11)])


def test_non_finite_loss_names_the_step_and_saves_nothing_of_it(tmp_path):
    task = Counting(_cfg(tmp_path), nan_at=5)
    with pytest.raises(NonFiniteLossError, match="at step 5"):
        run_loop(task)
    assert task.saved == [3] and task.evaluated == []  # read at step 5, before its evaluation


def test_registry_picks_the_application():
    from shardwise.apps.registry import app_for, apps

    assert [a.name for a in apps()] == ["cnn", "ps", "lm"]
    assert app_for(Config.load(overrides={"model.kind": "cnn"})).name == "cnn"
    assert app_for(Config.load(overrides={"parallel.mode": "ps"})).name == "ps"
    assert app_for(Config.load()).name == "lm"
