"""What can be trained (``registry``: one ``AppSpec`` each): the language model (``lm``), the
CNN with a per-layer plan (``cnn``), the parameter server (``param_server``)."""

from __future__ import annotations

from shardwise.base.config import Config


def check_config(cfg: Config) -> None:
    """The rules of the application ``cfg`` selects that need its model (``ValueError``, one
    line): run at the door, before any rank starts."""
    from shardwise.apps.registry import app_for

    app_for(cfg).check_config(cfg)
