"""The CNN application's checks at the door and its model settings (``model.kind = "cnn"``)."""

from __future__ import annotations

import torch

from shardwise.apps.cnn.chooser import resolve
from shardwise.base.config import CNNSection, Config, ConfigError
from shardwise.models.cnn import CNN, CNNConfig, parse_branches


def cnn_config(section: CNNSection) -> CNNConfig:
    """The model sizes of the ``[cnn]`` section (ValueError, one line, on a bad
    ``cnn.inception`` entry)."""
    return CNNConfig(channels=tuple(section.channels), kernel=section.kernel,
                     hidden=tuple(section.hidden), inception=parse_branches(section.inception))


def check_config(cfg: Config) -> None:
    """The CNN's rules, before any rank starts: it trains in fp32 on its own group of
    ``cnn.ranks`` (``ConfigError``, one line naming the field), and the plan must fit the
    model and the batch (``ValueError``, one line naming the layer; the model is built on the
    meta device only)."""
    p = cfg.parallel
    if p.cp > 1:
        raise ConfigError(f"parallel.cp={p.cp} with model.kind=cnn: context parallelism "
                          "splits a sequence; the CNN has none")
    if cfg.model.init_from:
        raise ConfigError("model.init_from with model.kind=cnn: Hugging Face checkpoints are "
                          "decoders (llama, gpt)")
    if p.mode != "grid" or p.zero or cfg.training.precision != "fp32":
        raise ConfigError("model.kind=cnn trains in fp32 on its own group (cnn.ranks): leave "
                          "parallel.mode, parallel.zero and training.precision at their "
                          "defaults")
    with torch.device("meta"):
        specs = CNN(cnn_config(cfg.cnn)).specs()
    resolve(cfg.cnn.plan, specs, cfg.training.global_batch_size, cfg.cnn.ranks)
