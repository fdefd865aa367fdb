"""What can be trained: the language model, the CNN with a per-layer plan, the parameter
server."""

from __future__ import annotations

from shardwise.base.config import Config


def check_config(cfg: Config) -> None:
    """The rules of the application ``cfg`` selects that need its model (``ValueError``, one
    line): run at the door, before any rank starts."""
    if cfg.model.kind == "cnn":
        from shardwise.apps.cnn.app import check_config as check
    elif cfg.parallel.mode == "ps":
        from shardwise.apps.param_server.app import check_config as check
    else:
        return
    check(cfg)
