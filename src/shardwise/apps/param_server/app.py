"""The parameter server's checks at the door (``parallel.mode = "ps"``)."""

from __future__ import annotations

from shardwise.apps.param_server.partition import count_keys
from shardwise.base.config import Config


def check_config(cfg: Config) -> None:
    """The parameter server trains the GPT, and every server must own at least one key
    range: ``ValueError`` (one line) otherwise."""
    if cfg.model.kind != "gpt":
        raise ValueError(f"model.kind={cfg.model.kind!r} with parallel.mode=ps: the parameter "
                         "server trains the GPT only (model.kind = \"gpt\")")
    keys = count_keys(cfg.model)
    if cfg.ps.servers > keys:
        raise ValueError(f"ps.servers={cfg.ps.servers} is more than the model's {keys} key "
                         "ranges (parameter tensors): a server would own nothing")
