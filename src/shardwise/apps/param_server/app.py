"""The parameter server's checks at the door (``parallel.mode = "ps"``)."""

from __future__ import annotations

from shardwise.apps.param_server.partition import count_keys
from shardwise.base.config import Config, ConfigError


def check_config(cfg: Config) -> None:
    """The parameter server's rules, before any rank starts: it trains the GPT from the seed,
    in fp32, by pure data parallelism over ``ps.workers``, and every server owns at least
    one key range. ``ConfigError`` (one line naming the field) otherwise."""
    p, m, t = cfg.parallel, cfg.model, cfg.training
    if m.kind != "gpt":
        raise ConfigError(f"model.kind={m.kind!r} with parallel.mode=ps: the parameter server "
                          "trains the GPT only; use parallel.mode = grid")
    if m.init_from:
        raise ConfigError("model.init_from with parallel.mode=ps: the parameter server starts "
                          "from the seed only; use parallel.mode = grid")
    if m.attention_mask != "causal":
        raise ConfigError(f"model.attention_mask={m.attention_mask!r} with parallel.mode=ps: "
                          "the parameter server's workers attend causally over the character "
                          "corpus; use parallel.mode = grid")
    for name, value in (("parallel.pp", p.pp), ("parallel.tp", p.tp), ("parallel.cp", p.cp),
                        ("parallel.ep", p.ep), ("parallel.micro_batches", p.micro_batches)):
        if value != 1:
            raise ConfigError(f"{name}={value} with parallel.mode=ps: the parameter server is "
                              "pure data parallelism; set it to 1")
    if p.zero or t.precision != "fp32":
        raise ConfigError("parallel.mode=ps trains in fp32 without ZeRO: set parallel.zero = 0 "
                          "and training.precision = fp32")
    if t.global_batch_size % cfg.ps.workers:
        raise ConfigError(f"training.global_batch_size={t.global_batch_size} must be "
                          f"divisible by ps.workers={cfg.ps.workers}")
    keys = count_keys(cfg.model)
    if cfg.ps.servers > keys:
        raise ConfigError(f"ps.servers={cfg.ps.servers} is more than the model's {keys} key "
                          "ranges (parameter tensors): a server would own nothing")
