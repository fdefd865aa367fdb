"""The one training loop every application runs (in the spirit of torchtitan's ``Trainer``
driving a ``TrainSpec``): the loop owns the cadence, the progress bar, the metrics rows, the
throughput and the non-finite-loss stop; the application owns its step, evaluation and
checkpoint, behind the small protocol of ``TrainTask``.

``run_loop(task, progress=None)`` trains until ``task.cfg.training.steps``::

    every step          task.train_step(sync=False)   losses may stay device tensors
                        (None: the step did not commit, fault tolerance: redone, not logged)
    log / eval / save   task.settle(info)             the loop's only host synchronisations
    log (log_every)     {"kind": "train", "step", **info, <unit>_per_s, step_s, flops_per_s, mfu}
                        (+ on CUDA peak_allocated_mib, peak_reserved_mib: one value per rank,
                        the window's peaks, ``training.memory``) to metrics.jsonl, and
                        TensorBoard / W&B when asked (``training.loggers``)
    eval / save         task.join_next_step() first (torchft: the next step's quorum)
    eval (eval_every)   {"kind": "val", "step", **task.evaluate()}
    save (every)        task.save_checkpoint(), then task.draw() on rank 0 (the loss curve)
    end                 task.end_of_training(); a last evaluation; checkpoint.at_end

A loop that stops early for any reason (an error; SIGTERM from the launcher stopping the run,
after which rank 0 dies of it as before) draws the curve so far on rank 0 on its way out.
Without a terminal the progress is one line per logged step (``ProgressLines``).

A loss that is not finite stops the run with ``NonFiniteLossError`` naming the step, before
anything of that step is saved (``settle`` runs before every save).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch

from shardwise.base.config import Config
from shardwise.base.errors import NonFiniteLossError
from shardwise.engine import settle
from shardwise.perf import Peak, Throughput, peak_flops
from shardwise.training import console
from shardwise.training.loggers import RunLog
from shardwise.training.memory import memory_postfix, peak_memory, reset_peaks


@dataclass(frozen=True)
class Cadence:
    """Steps between train rows (``log_every``), validations (``eval_every``; 0: only at the
    end) and checkpoints (``every``; 0: none during the run), and whether the last step is
    saved (``at_end``)."""

    log_every: int
    eval_every: int = 0
    checkpoint_every: int = 0
    at_end: bool = False

    @classmethod
    def from_config(cls, cfg: Config) -> Cadence:
        """``training.log_every``, ``training.eval_every``, ``checkpoint.every``, ``.at_end``."""
        return cls(cfg.training.log_every, cfg.training.eval_every, cfg.checkpoint.every,
                   cfg.checkpoint.at_end)


class TrainTask:
    """What the loop drives: one rank's share of an application's training.

    A subclass sets ``cfg``, ``is_main`` (rank 0: the bar and ``metrics.jsonl``), ``device``,
    ``step`` (optimizer steps done), ``samples_per_step`` (the ``sample_unit`` — "tokens",
    "images" — one optimizer step consumes, counted as the throughput's work),
    ``flops_per_sample`` (training FLOPs of one sample, or None: no MFU), ``world_size``
    (ranks sharing those FLOPs), ``dtype`` (the compute dtype, for the device's peak),
    ``cadence`` and ``memory_group`` (the ranks whose CUDA memory peaks a train row gathers:
    None, the world, when every rank runs the loop; "local", the default: this rank's own);
    and implements ``train_step``, ``evaluate``, ``save_checkpoint``. Each step's
    loss goes to ``record_loss``; ``settle`` reads them into ``history`` (floats, one per step).
    """

    cfg: Config
    is_main: bool = True
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    step: int = 0
    samples_per_step: int = 0
    sample_unit: str = "samples"
    flops_per_sample: float | None = None
    world_size: int = 1
    memory_group = "local"
    cadence: Cadence

    # -- the protocol ---------------------------------------------------------------------
    def train_step(self, sync: bool = True) -> dict | None:
        """One optimizer step (``self.step`` += 1); ``{"loss": ..., ...}``: with ``sync=False``
        values may be 0-d device tensors, read later by ``settle``. None: the step did not
        commit (per-step fault tolerance) and ``self.step`` is unchanged: the loop redoes it."""
        raise NotImplementedError

    def evaluate(self) -> dict | None:
        """Fields of a ``{"kind": "val"}`` row (``val_loss``, ...) at the current weights, or
        None (this rank has nothing to report). Collective where the application's is."""
        return None

    def eval_line(self, row: dict) -> str:
        """The line the bar prints for a validation row."""
        return f"step {row['step']}: validation loss {row['val_loss']:.4f}"

    def save_checkpoint(self):
        """Write a checkpoint of ``self.step`` (collective where the application's is)."""
        raise NotImplementedError

    def join_next_step(self) -> None:
        """Before a validation or a checkpoint between two steps: a task whose steps need
        its peers (a replica group of a torchft job) joins the next step here, so that the
        peers wait for it inside that step instead of going on without it; nothing by
        default."""

    def end_of_training(self) -> None:
        """After the last step, before the last evaluation (drain a pipeline, say done)."""

    def draw(self) -> None:
        """Redraw the run's loss curve from ``metrics.jsonl`` (rank 0: after each checkpoint,
        and when the loop stops early for any reason); nothing by default."""

    # -- losses ---------------------------------------------------------------------------
    def record_loss(self, loss: torch.Tensor | float) -> None:
        """Keep one step's loss (a 0-d tensor stays on its device until ``settle``)."""
        if not hasattr(self, "_pending"):
            self._pending = []
        self._pending.append(loss)

    def settle(self, info: dict | None = None) -> dict | None:
        """Read the pending losses into ``self.history`` (one host synchronisation) and
        ``info``'s tensors into floats. Raises ``NonFiniteLossError`` naming the first step
        whose loss is not finite."""
        pending = getattr(self, "_pending", [])
        if not hasattr(self, "history"):
            self.history = []
        if pending:
            first = self.step - len(pending) + 1
            losses = torch.stack([torch.as_tensor(v).detach().double().reshape(()).cpu()
                                  for v in pending]).tolist()
            self._pending = []
            for i, v in enumerate(losses):
                if not math.isfinite(v):
                    raise NonFiniteLossError(
                        f"training loss is {v} at step {first + i}: stopped; nothing of this "
                        "or later steps is saved (lower optimizer.lr or check the data)")
            self.history.extend(losses)
        return settle(info) if info is not None else None

    def throughput(self) -> Throughput:
        """Samples/s, FLOP/s per rank and MFU against ``perf.peak_flops`` of this rank's
        device in ``dtype`` (``training.peak_tflops`` if set)."""
        t = self.cfg.training
        if self.flops_per_sample:
            peak = peak_flops(self.device, self.dtype, t.tf32, t.peak_tflops)
        else:
            peak = Peak(None, "the application counts no FLOPs")
        return Throughput(self.flops_per_sample or 0.0, self.world_size, peak)


class ProgressLines:
    """The progress of a run without a terminal (a log file, a pipe): one whole line on
    stderr per logged step (``set_postfix`` then ``update``), ``train: step 20/100 (20%),
    0:00:12 elapsed, 0:00:48 left, loss=2.345 tok_s=5120``; no carriage returns, so the
    other lines of the log never land inside a bar. tqdm's ``update`` / ``set_postfix`` /
    ``close`` / ``write``, as ``run_loop`` uses them."""

    def __init__(self, total: int, initial: int, stream=None):
        import sys

        self.total, self.n, self.first = total, initial, initial
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.perf_counter()
        self._postfix: dict | None = None

    def set_postfix(self, postfix: dict, refresh: bool = False) -> None:
        """The fields of the next line (printed by the next ``update``)."""
        self._postfix = dict(postfix)

    def update(self, n: int = 1) -> None:
        """``n`` more steps done; prints a line if ``set_postfix`` came since the last."""
        self.n += n
        if self._postfix is None:
            return
        fields, self._postfix = " ".join(f"{k}={v}" for k, v in self._postfix.items()), None
        elapsed = time.perf_counter() - self.started
        done = self.n - self.first
        left = elapsed / done * (self.total - self.n) if done else 0.0
        self.write(f"train: step {self.n}/{self.total} ({100 * self.n // max(1, self.total)}%), "
                   f"{_clock(elapsed)} elapsed, {_clock(left)} left, {fields}")

    def write(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """Nothing to clear: every line is whole."""


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}"


def progress_bar(total: int, initial: int):
    """On a terminal, a live tqdm bar on stderr; otherwise ``ProgressLines`` (one line per
    logged step)."""
    import sys

    if not sys.stderr.isatty():
        return ProgressLines(total, initial)
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())  # tqdm's default multiprocessing lock leaks a semaphore at os._exit
    return console.live(tqdm(total=total, initial=initial, desc="train", unit="step",
                             dynamic_ncols=True, mininterval=0.5))  # status lines above it


def _rates(task: TrainTask, rate: Throughput) -> dict:
    r = rate.mark()
    out = {f"{task.sample_unit}_per_s": r.pop("tokens_per_s"), **r}
    if not task.flops_per_sample:
        out["flops_per_s"] = out["mfu"] = None
    return out


def run_loop(task: TrainTask, progress: bool | None = None) -> dict:
    """Train ``task`` from ``task.step`` to ``training.steps`` (see module docstring).
    ``progress``: show the bar on rank 0 (default ``training.progress``). Returns ``step``,
    ``loss`` (the last step's), the last evaluation's fields (``val_loss``, ...) and
    ``elapsed_s`` (this loop's seconds)."""
    t, c = task.cfg.training, task.cadence
    show = task.is_main and (t.progress if progress is None else progress)
    metrics = RunLog(task.cfg, enabled=task.is_main, device=task.device)  # jsonl, TB, W&B
    bar = progress_bar(t.steps, task.step) if show else None
    rate = task.throughput()
    reset_peaks(task.device)  # the rows' memory peaks count training steps, per window
    started = time.perf_counter()
    draw_on_term = task.is_main and threading.current_thread() is threading.main_thread()
    term = signal.signal(signal.SIGTERM, _draw_then_die(task)) if draw_on_term else None
    try:
        while task.step < t.steps:
            info = task.train_step(sync=False)
            if info is None:  # not committed across the replica groups: redone
                continue
            rate.add(task.samples_per_step)
            s = task.step
            log = s % c.log_every == 0 or s == t.steps
            evaluate = bool(c.eval_every) and s % c.eval_every == 0 and s < t.steps
            save = bool(c.checkpoint_every) and s % c.checkpoint_every == 0 and s < t.steps
            if log or evaluate or save:
                info = task.settle(info)
                rate.pause()  # evaluation and checkpoints are not training time
            if log:
                row = {"kind": "train", "step": s, **info, **_rates(task, rate),
                       **peak_memory(task.device, task.memory_group)}  # CUDA; CPU: {}
                metrics.write(row)
                if bar is not None:
                    bar.set_postfix(_postfix(task, row), refresh=False)  # redrawn at mininterval
            if bar is not None:
                bar.update(1)
            if evaluate or save:  # steps are left: join the next one before the pause
                task.join_next_step()
            if evaluate:
                _evaluate(task, metrics, show)
            if save:
                task.save_checkpoint()
                if task.is_main:
                    task.draw()
            rate.resume()
    except BaseException:  # an error, Ctrl-C in one process: the curve so far
        if task.is_main:
            _draw_quietly(task)
        raise
    finally:
        if term is not None:
            signal.signal(signal.SIGTERM, term)
        if bar is not None:
            bar.close()
    try:
        task.settle()
        task.end_of_training()
        last = _evaluate(task, metrics, show)
    finally:
        metrics.close()
    if c.at_end:
        task.save_checkpoint()
    history = getattr(task, "history", [])
    return {"step": task.step, "loss": history[-1] if history else None, **last,
            "elapsed_s": time.perf_counter() - started}


def _draw_then_die(task: TrainTask):
    """Rank 0's SIGTERM handler in the loop (the launcher stopping the run, Ctrl-C): draw
    the curve so far, then die of the signal as before (``_die``)."""
    def handler(signum, frame):
        _draw_quietly(task)
        _die(signum)
    return handler


def _die(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _draw_quietly(task: TrainTask) -> None:
    """``task.draw()`` on the way out of a failed loop: its own failure must not hide why
    the loop stopped."""
    try:
        task.draw()
    except Exception:
        pass


def _postfix(task: TrainTask, row: dict) -> dict:
    unit = {"tokens": "tok", "images": "img"}.get(task.sample_unit, task.sample_unit)
    out = {"loss": f"{row['loss']:.3f}", f"{unit}_s": f"{row[f'{task.sample_unit}_per_s']:.0f}"}
    if task.flops_per_sample:
        out["mfu"] = f"{100 * row['mfu']:.0f}%" if row["mfu"] is not None else "n/a"
    mem = memory_postfix(row)  # CUDA: the busiest rank's peak allocated / reserved, GiB
    if mem is not None:
        out["mem"] = mem
    return out


def _evaluate(task: TrainTask, metrics: RunLog, show: bool) -> dict:
    fields = task.evaluate()
    if fields is None:
        return {}
    row = {"kind": "val", "step": task.step, **fields}
    metrics.write(row)
    if show:
        console.status(task.eval_line(row))  # above a live bar
    return fields
