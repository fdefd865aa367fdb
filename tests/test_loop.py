"""The shared training loop as pure logic (no ranks): cadence of rows, evaluations and
checkpoints; the non-finite stop saves nothing of its step; the registry picks the app."""

import json
import os
import signal

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


class FakeCuda:
    """torch.cuda's peak-memory calls on a made-up device: the peaks grow by 1 MiB a read
    (allocated) and 2 MiB (reserved) and count resets."""

    def __init__(self, monkeypatch):
        import torch

        self.reads, self.resets = 0, 0
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", self._alloc)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", self._reserved)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self._reset)

    def _alloc(self, device=None):
        self.reads += 1
        return (1536 + self.reads) * 2**20

    def _reserved(self, device=None):
        return (2048 + 2 * self.reads) * 2**20

    def _reset(self, device=None):
        self.resets += 1


def test_cuda_rows_carry_peak_memory_per_rank(tmp_path, monkeypatch):
    import torch

    from shardwise.training.loop import _postfix

    fake = FakeCuda(monkeypatch)
    task = Counting(_cfg(tmp_path, eval_every=0))
    task.device = torch.device("cuda", 0)
    run_loop(task)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["peak_allocated_mib"] for r in train] == [[1537.0], [1538.0], [1539.0]]
    assert [r["peak_reserved_mib"] for r in train] == [[2050.0], [2052.0], [2054.0]]
    assert fake.resets == 1 + len(train)  # at the start, then a window per train row
    assert all("peak_allocated_mib" not in r for r in rows if r["kind"] == "val")
    assert _postfix(task, train[0])["mem"] == "1.5/2.0G"


def test_cpu_rows_carry_no_memory(tmp_path):
    task = Counting(_cfg(tmp_path))
    run_loop(task)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows and not any("peak_allocated_mib" in r or "peak_reserved_mib" in r for r in rows)
    from shardwise.training.loop import _postfix

    assert "mem" not in _postfix(task, rows[0] | {"images_per_s": 1.0})


def test_memory_postfix_names_the_busiest_rank():
    from shardwise.training.memory import memory_postfix

    row = {"peak_allocated_mib": [1024.0, 3072.0, 2048.0], "peak_reserved_mib": [4096.0, 3584.0, 2048.0]}
    assert memory_postfix(row) == "3.0/4.0G@r1"  # max allocated (rank 1) / max reserved
    assert memory_postfix({"loss": 1.0}) is None


def test_tensorboard_scalars_take_the_busiest_rank():
    from shardwise.training.loggers import _memory_mib

    out = _memory_mib({"kind": "train", "peak_allocated_mib": [10.0, 30.0],
                       "peak_reserved_mib": [40.0, 35.0]})
    assert out["memory/peak_allocated_mib_max"] == 30.0
    assert out["memory/peak_reserved_mib_max"] == 40.0 and out["memory/max_rss_mib"] > 0
    assert set(_memory_mib({"kind": "train"})) == {"memory/max_rss_mib"}


def test_every_ranks_memory_reaches_the_row():
    """The gather behind the per-rank lists, on two CPU ranks (the same comm.all_reduce the
    CUDA path runs on the device): every rank gets every rank's values, in rank order."""
    from memory_workers import gather

    from shardwise.launch import spawn

    values = [[1.5, 10.0], [2.5, 20.0]]
    r0, r1 = spawn(gather, 2, (values,))
    assert r0 == r1 == [[1.5, 2.5], [10.0, 20.0]]


class Drawing(Counting):
    """``Counting`` that records each ``draw`` (the loss curve) and can signal itself."""

    def __init__(self, cfg, nan_at=None, term_at=None):
        super().__init__(cfg, nan_at)
        self.drawn, self.term_at = [], term_at

    def train_step(self, sync=True):
        if self.step + 1 == self.term_at:
            os.kill(os.getpid(), signal.SIGTERM)  # the launcher stopping the run
        return super().train_step(sync)

    def draw(self):
        self.drawn.append(self.step)


def test_the_loss_curve_is_drawn_at_each_checkpoint_and_when_the_loop_stops(tmp_path,
                                                                            monkeypatch):
    from shardwise.training import loop

    task = Drawing(_cfg(tmp_path))
    run_loop(task)
    assert task.drawn == [3, 6, 9]  # the end's curve is the application's (finish)
    task = Drawing(_cfg(tmp_path / "nan"), nan_at=5)
    with pytest.raises(NonFiniteLossError):
        run_loop(task)
    assert task.drawn == [3, 5]

    class Died(BaseException):
        pass

    def unhandled(signum, frame):
        raise RuntimeError("SIGTERM reached the handler from before the loop")

    def die(signum):  # (the real one kills this process with the signal)
        raise Died(signum)

    monkeypatch.setattr(loop, "_die", die)
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        task = Drawing(_cfg(tmp_path / "term"), term_at=5)
        with pytest.raises(Died):
            run_loop(task)
        assert task.drawn[:2] == [3, 4]  # drawn by the handler, before dying
        assert signal.getsignal(signal.SIGTERM) is unhandled
    finally:
        signal.signal(signal.SIGTERM, before)


def test_without_a_terminal_progress_is_one_whole_line_per_logged_step(tmp_path, capsys):
    run_loop(Counting(_cfg(tmp_path)), progress=True)  # pytest's stderr is no terminal
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "train: step 4/10 (40%)", "train: step 8/10 (80%)", "train: step 10/10 (100%)"], err
    assert "loss=0.250" in lines[0] and " left, " in lines[0]


def test_the_loss_curve_names_its_unit(tmp_path, monkeypatch):
    import matplotlib.axes

    from shardwise.training.metrics import plot_loss

    labels = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_ylabel",
                        lambda self, text, *a, **k: labels.append(text))
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0}\n')
    for unit in ("token", "char"):
        plot_loss(tmp_path / "metrics.jsonl", tmp_path / "loss.png", unit=unit)
    assert labels == ["cross-entropy (nats / token)", "cross-entropy (nats / char)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "metrics.jsonl"]
