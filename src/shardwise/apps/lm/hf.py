"""``model.init_from = "hf:DIR"``: a run's model taken from a Hugging Face checkpoint.

At the door (``resolve_init_from``, then ``check_init_from``), before any rank starts:
``DIR/config.json`` gives the model's kind and sizes (``models.hf.section_of``); a [model]
field the user set to another value is refused in one line, and the safetensors headers
must hold exactly the tensors those sizes imply, in those shapes. The ranks then read only
their slices (``engine.model._load_hf``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardwise.base.config import Config, ConfigError
from shardwise.checkpoint.hf import HFCheckpointError, SafetensorsDir, read_config
from shardwise.models.description import describe_section
from shardwise.models.hf import HFConfigError, hf_shapes, section_of


def init_dir(cfg: Config) -> Path | None:
    """The checkpoint directory of ``model.init_from`` ("hf:DIR"), or None when unset."""
    spec = cfg.model.init_from
    return Path(spec.removeprefix("hf:")).expanduser() if spec else None


def source_config(cfg: Config) -> dict | None:
    """The ``config.json`` of ``model.init_from``, or None when unset (``HFCheckpointError``,
    one line, when it cannot be read)."""
    path = init_dir(cfg)
    return None if path is None else read_config(path)


def resolve_init_from(cfg: Config) -> Config:
    """``cfg`` with its [model] section filled from ``model.init_from``'s config.json (kind,
    sizes, norms, rotary settings, tying); ``cfg`` itself when unset. Idempotent.

    A field set explicitly (in the TOML file or on the command line,
    ``ModelConfig.model_fields_set``) must equal the checkpoint's, except the fields its
    arch lets a run lower (the Llama's ``block_size``: training windows shorter than the
    checkpoint's context). Raises ``ConfigError`` (one line) for a missing directory or
    config.json, an unsupported architecture or option, or a contradicting field."""
    if not cfg.model.init_from:
        return cfg
    where = f"model.init_from={cfg.model.init_from}"
    try:
        hf_cfg = source_config(cfg)
        fields = section_of(hf_cfg)
    except (HFCheckpointError, HFConfigError) as e:
        raise ConfigError(f"{where}: {e}") from None
    from shardwise.models.hf import arch_of

    arch = arch_of(hf_cfg)
    m = cfg.model
    for name, value in fields.items():
        ours = getattr(m, name)
        if name not in m.model_fields_set or ours == value:
            continue
        if name in arch.at_most and isinstance(ours, int) and ours <= value:
            fields[name] = ours  # shorter training windows than the checkpoint's context
            continue
        bound = " or less" if name in arch.at_most else ""
        reason = arch.bound_reason(hf_cfg).get(name) if bound else None  # Phi-3's LongRoPE
        bound += f", {reason}" if reason else ""
        raise ConfigError(f"model.{name}={ours!r} contradicts {where} (config.json gives "
                          f"{value!r}{bound}); leave model.{name} unset (the config file "
                          "too: configs/finetune_hf.toml sets no [model] size)")
    data = cfg.model_dump()
    data["model"].update(fields)
    return Config.from_dict(data)


def check_init_from(cfg: Config, vocab_size: int | None = None) -> None:
    """At the door, after ``resolve_init_from``: the checkpoint's safetensors hold every
    tensor the resolved model has, in its shape, and no tensor it would ignore (other than
    old buffers), reading the files' headers only; the tokenizer's vocabulary
    (``vocab_size``) is at most the model's. ``ConfigError``, one line."""
    path = init_dir(cfg)
    if path is None:
        return
    where = f"model.init_from={cfg.model.init_from}"
    d = describe_section(cfg.model, cfg.model.vocab_size)
    try:  # the checkpoint's own arch when it holds the model (Phi-3's packed tensors), under
        # the names its files hold (a Gemma3ForConditionalGeneration's language model)
        files = SafetensorsDir(path)
        d = d.with_checkpoint_arch(source_config(cfg), files)
        have = {n: files.shape(n) for n in files.names()}
    except (HFCheckpointError, HFConfigError) as e:
        raise ConfigError(f"{where}: {e}") from None
    if d.hf is None:
        raise ConfigError(f"{where}: model.kind={d.kind!r} has no Hugging Face mapping")
    if vocab_size is not None and vocab_size > d.vocab_size:
        raise ConfigError(f"{where}: the tokenizer has {vocab_size} tokens, more than the "
                          f"model's vocabulary of {d.vocab_size} (config.json vocab_size)")
    with torch.device("meta"):
        model = d.build()
    want = hf_shapes(d, model)
    for name, shape in want.items():
        if name not in have:
            raise ConfigError(f"{where}: the checkpoint has no tensor {name} (config.json "
                              f"implies one of shape {list(shape)})")
        if have[name] != shape:
            raise ConfigError(f"{where}: {name} has shape {list(have[name])} in the "
                              f"checkpoint, config.json implies {list(shape)}")
    extra = [n for n in have if n not in want and not d.hf.is_ignored(n)]
    if d.tied is not None:  # a tied head saved anyway is the embedding's matrix again
        extra = [n for n in extra if n != d.hf.tensor(d.tied[1]).name]
    if extra:
        raise ConfigError(f"{where}: the checkpoint holds {extra[0]}, which "
                          f"{d.hf.architecture} of this config.json has no place for"
                          + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
