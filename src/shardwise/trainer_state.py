"""Checkpoint state of a ``Trainer``: ``state_dict`` / ``load_state_dict``, save and resume.

The state is two parts: tensors, which go through DCP, and meta (JSON), which is written
beside them. The tensors are the model in the unsharded GPT's names, AdamW moments keyed by
parameter name (or, under ZeRO, by this rank's piece of it, fp32 master included), and
each rank's RNG state under its own key. Tensor-parallel runs gather to that layout, so a
checkpoint resumes into another tp or dp size. A pipeline rank saves only the stages it
trains.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardwise import checkpoint
from shardwise import tensor_parallel as tp


class TrainerState:
    """Mixin of ``Trainer``: everything about saving and restoring its state."""

    def state_dict(self) -> tuple[dict, dict]:
        """``(tensors, meta)``: tensors for DCP (model, AdamW moments, this rank's RNG),
        meta JSON-able (step, scheduler, sampler, optimizer hyper-parameters, tokenizer,
        config, layout)."""
        opt = self.optimizer.state_dict()
        if self.tp is not None:  # the unsharded layout: loadable into any tp size
            model_tensors = tp.gather_state_dict(self.model, self.tp)
            moments = tp.gather_optimizer_state(self.model, self.optimizer, self.tp)
            for n, full in model_tensors.items():
                moments.setdefault(n, _fresh_moments(full))
        else:  # a pipeline rank saves only the stages it trains
            named = (self.pipeline.named_parameters() if self.pipeline is not None
                     else self.model.named_parameters())
            model_tensors = {n: p.detach() for n, p in named}
            names = self._optimizer_param_names()
            moments = {}
            for i, p in enumerate(q for g in self.optimizer.param_groups for q in g["params"]):
                st = opt["state"].get(i)
                moments[names[id(p)]] = dict(st) if st is not None else _fresh_moments(p)
                if self.zero is not None:
                    moments[names[id(p)]]["master"] = p  # fp32 master weights of this shard
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        tensors = {"model": model_tensors, "optimizer": moments,
                   "rng": {f"rank{self.topology.rank}": rng}}
        meta = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),  # lr_lambdas are stored as None
            "sampler": self.sampler.state_dict(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in opt["param_groups"]],
            "history": self.history,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
            "tokenizer": self.tokenizer.state_dict(),
            "config": self.cfg.model_dump(),
            "layout": {"dp": self.topology.dp, "pp": self.topology.pp, "tp": self.topology.tp},
        }
        return tensors, meta

    def load_state_dict(self, tensors: dict, meta: dict) -> None:
        self.step = meta["step"]
        self.history = list(meta["history"])
        self.sampler.load_state_dict(meta["sampler"])
        self.scheduler.load_state_dict(dict(meta["scheduler"]))
        by_name = tensors["optimizer"]
        if self.tp is not None:
            state = {}  # set below from the full layout, sliced for this rank
        else:
            names = self._optimizer_param_names()
            order = [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
            state = {i: {k: v for k, v in by_name[n].items() if k != "master"}  # loaded in place
                     for i, n in enumerate(order) if float(by_name[n]["step"]) > 0}
        if self.loss_scaler is not None and meta.get("loss_scaler"):
            self.loss_scaler.load_state_dict(meta["loss_scaler"])
        groups, offset = [], 0
        for saved, live in zip(meta["param_groups"], self.optimizer.param_groups):
            n = len(live["params"])
            groups.append(dict(saved, params=list(range(offset, offset + n))))
            offset += n
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        if self.tp is not None:
            started = {n: m for n, m in by_name.items() if float(m["step"]) > 0}
            tp.load_optimizer_state(self.model, self.optimizer, started, self.tp)
        rng = tensors["rng"].get(f"rank{self.topology.rank}")
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.device)

    def save_checkpoint(self) -> Path:
        """Write a checkpoint of this step (collective). PipeDream drains its stream first:
        activations in flight are not saved, so a resumed run starts a new stream, exactly
        as the run that saved it continues."""
        if self.pipeline is not None:
            self.pipeline.drain()
        with self._full_parameters():  # the same full-model format for every ZeRO stage
            tensors, meta = self.state_dict()
            return checkpoint.save(self.cfg.checkpoint_dir, self.step, tensors, meta,
                                   keep=self.cfg.checkpoint.keep)

    def resume(self, path: str | Path | None = None) -> Path:
        """Load ``path`` or the latest complete checkpoint of ``checkpoint_dir``."""
        path = Path(path) if path else checkpoint.latest_checkpoint(self.cfg.checkpoint_dir)
        if path is None:
            raise checkpoint.CheckpointError(
                f"no complete checkpoint in {str(self.cfg.checkpoint_dir)!r}")
        with self._full_parameters():
            tensors, _ = self.state_dict()
            meta = checkpoint.load(path, tensors)  # in place: parameters and masters
            if self.tp is not None:
                tp.load_full_state_dict(self.model, tensors["model"], self.tp)
        if self.zero is not None:
            self.zero.refresh_params()  # the masters were loaded in place: rebuild the weights
        self.load_state_dict(tensors, meta)
        return path

    def _optimizer_param_names(self) -> dict[int, str]:
        """Checkpoint key of each optimizer parameter: the model's names, or for ZeRO the
        piece names (parameter and element range), which differ between ranks."""
        if self.zero is not None:
            return {id(m): n for m, n in zip(self.zero.pieces, self.zero.piece_names)}
        if self.pipeline is not None:
            return {id(p): n for n, p in self.pipeline.named_parameters()}
        return {id(p): n for n, p in self.model.named_parameters()}


def _fresh_moments(like: torch.Tensor) -> dict:
    """AdamW state before its first step, allocated so that a checkpoint load has a target."""
    return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(like),
            "exp_avg_sq": torch.zeros_like(like)}
