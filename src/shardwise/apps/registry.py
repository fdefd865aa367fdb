"""What can be trained: one ``AppSpec`` per application, looked up from the config (as
torchtitan's ``TrainSpec`` registry), instead of ``if`` chains in the CLI and the ranks.

An application is one ``register(AppSpec(...))``: which configs it handles, its checks at the
door (config, data, a checkpoint to resume), its per-rank entry point and its closing line.
The first registered spec that handles a config wins; the language model, registered last,
handles every config the others do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from shardwise.base.config import Config


def _nothing(cfg: Config) -> None:
    return None


@dataclass(frozen=True)
class AppSpec:
    """One application.

    ``handles(cfg)``: whether ``cfg`` selects it. ``check_config(cfg)``: its own rules, its
    sections against the others' and against its model (``Config`` checks only what holds
    for every application; ``ValueError``, one line), and ``check_data(cfg)``: its data is
    there and large enough (``DataError`` / ``ValueError``, one line); both run at the door,
    before any rank starts. ``train_rank(cfg_dict, device, resume)``: every rank's entry point
    (``torch.distributed`` is up with ``cfg.world_size`` ranks; ``device`` None: the
    application's default; ``resume``: a checkpoint path, True for the newest, or False),
    returning that rank's summary. ``result_rank(cfg)``: the rank whose summary the closing
    line reads; ``summary(result)``: that line's text after the step count and wall time.
    ``check_resumable(path, cfg)``: ``CheckpointError`` unless this application can resume
    ``path`` (None: the run directory's checks suffice). ``resolve(cfg)``: the config with
    what files decide filled in (the model of ``model.init_from``), first at the door (the
    ranks get the result); ``ValueError``, one line.
    """

    name: str
    description: str
    handles: Callable[[Config], bool]
    train_rank: Callable[[dict, torch.device | None, bool | str], dict]
    summary: Callable[[dict], str]
    check_config: Callable[[Config], None] = _nothing
    check_data: Callable[[Config], None] = _nothing
    check_resumable: Callable[[str | Path, Config], None] | None = None
    result_rank: Callable[[Config], int] = lambda cfg: 0
    resolve: Callable[[Config], Config] = lambda cfg: cfg


_APPS: list[AppSpec] = []


def register(spec: AppSpec) -> AppSpec:
    """Add ``spec`` (before the specs registered after it); ``ValueError`` if its name is
    taken."""
    if any(a.name == spec.name for a in _APPS):
        raise ValueError(f"an application named {spec.name!r} is already registered")
    _APPS.append(spec)
    return spec


def apps() -> list[AppSpec]:
    """Every registered application, in the order ``app_for`` tries them."""
    return list(_APPS)


def app_for(cfg: Config) -> AppSpec:
    """The application ``cfg`` selects (``model.kind``, ``parallel.mode``)."""
    for spec in _APPS:
        if spec.handles(cfg):
            return spec
    raise ValueError("no application handles this config (model.kind, parallel.mode)")


def _check_images(cfg: Config) -> None:
    from shardwise.data.idx import check_image_dir

    check_image_dir(cfg.data.path)  # a directory of IDX files (issue 16)


def _register_builtin() -> None:
    from shardwise.apps.cnn import app as cnn_app
    from shardwise.apps.cnn import training as cnn_training
    from shardwise.apps.lm import app as lm_app
    from shardwise.apps.lm.text import check_corpus
    from shardwise.apps.param_server import app as ps_app
    from shardwise.apps.param_server import state as ps_state
    from shardwise.apps.param_server import training as ps_training

    register(AppSpec(
        name="cnn", description="a CNN on Fashion-MNIST with a per-layer plan (model.kind = cnn)",
        handles=lambda cfg: cfg.model.kind == "cnn", train_rank=cnn_training.train_rank,
        summary=cnn_training.summary, check_config=cnn_app.check_config,
        check_data=_check_images))
    register(AppSpec(
        name="ps", description="a GPT on text with a parameter server (parallel.mode = ps)",
        handles=lambda cfg: cfg.parallel.mode == "ps", train_rank=ps_training.train_rank,
        summary=lm_app.summary, check_config=ps_app.check_config, check_data=check_corpus,
        check_resumable=ps_state.check_resumable,
        result_rank=lambda cfg: cfg.ps.servers))  # worker 0: after the servers' ranks
    register(AppSpec(
        name="lm", description="a decoder (gpt, llama or yours: model.kind, model.module) on "
        "text in any dp x tp x pp layout (the default)",
        handles=lambda cfg: True, train_rank=lm_app.train_rank, summary=lm_app.summary,
        check_config=lm_app.check_config, check_data=lm_app.check_data,
        check_resumable=lm_app.check_resumable, resolve=lm_app.resolve))


_register_builtin()
