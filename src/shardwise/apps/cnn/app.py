"""The CNN application's checks at the door and its model settings (``model.kind = "cnn"``)."""

from __future__ import annotations

import torch

from shardwise.apps.cnn.chooser import resolve
from shardwise.base.config import CNNSection, Config
from shardwise.models.cnn import CNN, CNNConfig


def cnn_config(section: CNNSection) -> CNNConfig:
    """The model sizes of the ``[cnn]`` section."""
    return CNNConfig(channels=tuple(section.channels), kernel=section.kernel,
                     hidden=tuple(section.hidden))


def check_config(cfg: Config) -> None:
    """The plan must fit the model and the batch: ``ValueError`` (one line naming the layer)
    otherwise. Run before any rank starts; builds the model on the meta device only."""
    with torch.device("meta"):
        specs = CNN(cnn_config(cfg.cnn)).specs()
    resolve(cfg.cnn.plan, specs, cfg.training.global_batch_size, cfg.cnn.ranks)
