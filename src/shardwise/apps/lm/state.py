"""Checkpoint state of the language model's ``Trainer``: ``state_dict`` /
``load_state_dict``, save and resume.

The state is two parts: tensors, which go through DCP, and meta (JSON), which is written
beside them. The tensors are the engine's in logical form (``engine.state``: fp32 masters
and AdamW moments as the single-process model's tensors, whatever the layout); meta holds
the step, scheduler, the sampler's global position, optimizer hyper-parameters, loss
scale, tokenizer, config, the layout that wrote it and, under fault tolerance, torchft's
counters (``FaultTolerantReplica.state_dict``: its step and the slots trained). Nothing in
either depends on the layout, so a checkpoint resumes into any dp x cp x tp x pp, ZeRO
stage and precision.
"""

from __future__ import annotations

from pathlib import Path

from shardwise import checkpoint
from shardwise.engine import state as engine_state


class TrainerState:
    """Mixin of ``Trainer``: everything about saving and restoring its state."""

    def state_dict(self, joined: bool = True) -> tuple[dict, dict]:
        """``(tensors, meta)``: logical tensors for DCP (``engine.state.logical_tensors``),
        meta JSON-able. Collective over tp and dp: call inside ``engine.full_parameters()``;
        ``joined=False``: this rank's own pieces, no communication (a fault-tolerant heal)."""
        e = self.engine
        tensors = engine_state.logical_tensors(e, joined=joined)
        p = self.cfg.parallel
        meta = {
            "format": engine_state.FORMAT,
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),  # lr_lambdas are stored as None
            "sampler": self.sampler.state_dict(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in self.optimizer.param_groups],
            "history": self.history,
            "loss_scaler": e.loss_scaler.state_dict() if e.loss_scaler else None,
            "tokenizer": self.tokenizer.state_dict(),
            # model.init_from's config.json: `shardwise export` writes ours over it
            "hf_config": getattr(self, "hf_config", None),
            "config": self.cfg.model_dump(),
            # torchft's step and committed slots (fault_tolerance), None without
            "torchft": self.ft.state_dict() if getattr(self, "ft", None) is not None else None,
            "layout": {"dp": self.topology.dp, "pp": self.topology.pp, "tp": self.topology.tp,
                       "cp": self.topology.cp,
                       "zero": p.zero, "precision": self.cfg.training.precision},
        }
        return tensors, meta

    def load_state_dict(self, tensors: dict, meta: dict) -> None:
        """Restore from ``tensors`` (as DCP filled them) and ``meta``."""
        self.step = self.engine.step = meta["step"]
        self.history = list(meta["history"])
        self.sampler.load_state_dict(meta["sampler"])
        self.scheduler.load_state_dict(dict(meta["scheduler"]))
        for saved, live in zip(meta["param_groups"], self.optimizer.param_groups):
            live.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
        if meta.get("hf_config") is not None:
            self.hf_config = meta["hf_config"]
        e = self.engine
        if e.loss_scaler is not None and meta.get("loss_scaler"):
            e.loss_scaler.load_state_dict(meta["loss_scaler"])
        engine_state.load_logical_tensors(e, tensors)
        if getattr(self, "ft", None) is not None:  # torchft counts on from the same step
            # a checkpoint without its counters (written without fault tolerance): every
            # step trained the whole global batch, group_size slots
            counters = meta.get("torchft") or {
                "batches_committed": self.step * self.cfg.fault_tolerance.group_size}
            self.ft.load_state_dict({**counters, "step": self.step})

    def save_checkpoint(self) -> Path:
        """Write a checkpoint of this step (collective). PipeDream drains its stream first:
        activations in flight are not saved, so a resumed run starts a new stream, exactly
        as the run that saved it continues.

        With ``checkpoint.async_save`` the tensors (CPU copies) are written by a background
        thread while training goes on; one save is in flight at a time (a new one waits for
        the last), and ``wait_for_checkpoint`` must run before the process ends."""
        self.engine.drain()
        self.wait_for_checkpoint()
        with self.engine.full_parameters():  # the same full-model format for every ZeRO stage
            tensors, meta = self.state_dict()
        ck = self.cfg.checkpoint
        if ck.async_save:
            self._pending_save = checkpoint.save_async(self.cfg.checkpoint_dir, self.step,
                                                       tensors, meta, keep=ck.keep)
            return self._pending_save.path
        return checkpoint.save(self.cfg.checkpoint_dir, self.step, tensors, meta, keep=ck.keep)

    def wait_for_checkpoint(self) -> Path | None:
        """Block until the checkpoint being written in the background (if any) is complete;
        its path, or None. Raises ``CheckpointError`` if writing it failed."""
        pending, self._pending_save = getattr(self, "_pending_save", None), None
        return pending.wait() if pending is not None else None

    def resume(self, path: str | Path | None = None) -> Path:
        """Load ``path`` or the latest complete checkpoint of ``checkpoint_dir``."""
        path = Path(path) if path else checkpoint.latest_checkpoint(self.cfg.checkpoint_dir)
        if path is None:
            raise checkpoint.CheckpointError(
                f"no complete checkpoint in {str(self.cfg.checkpoint_dir)!r}")
        if checkpoint.read_meta(path).get("format") != engine_state.FORMAT:
            raise checkpoint.CheckpointError(
                f"{path}: written by an older shardwise (per-piece tensors, format "
                f"{checkpoint.read_meta(path).get('format', 1)}); it loads only with that "
                "version; --fresh starts over")
        with self.engine.full_parameters():  # targets: this rank's logical tensors
            tensors = engine_state.logical_tensors(self.engine, targets=True)
        if "buffers" in tensors:  # a routing bias the saving run had not (rate 0 then):
            have = checkpoint.tensor_names(path)  # it starts at zero here, as in a new run
            tensors["buffers"] = {n: t for n, t in tensors["buffers"].items()
                                  if f"buffers.{n}" in have}
        meta = checkpoint.load(path, tensors)  # in place into the targets just built
        self.load_state_dict(tensors, meta)
        return path
