"""``shardwise generate RUN_DIR --prompt TEXT``: sample from a checkpoint in the layout of
the current launch.

``generation_config`` (on the launcher) turns the run's saved config into the config of this
launch: the run's model and tokenizer, the layout of the command line (one process unless
``--parallel.tp 2`` and the like, or torchrun's world), the weights from the checkpoint
(``model.init_from`` is dropped). ``generate_rank`` (on every rank) builds the engine in
that layout, loads the checkpoint's ``model.*`` tensors into it (each rank its own slices,
``engine.state.load_logical_tensors``; no optimizer state) and runs ``Engine.generate``:
the last stage samples, tp ranks draw alike from one seeded generator, pipeline stages
receive the token, so every rank returns the same ids.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from shardwise import checkpoint, comm
from shardwise.base.config import Config, ConfigError
from shardwise.base.topology import Topology, init_process_groups
from shardwise.data.tokenizer import tokenizer_from_state
from shardwise.engine import Engine, EngineConfig
from shardwise.engine import state as engine_state
from shardwise.models import describe_section

# the layout of a launch that names none: one process, no pipeline, no sharding
_ONE_PROCESS = {"mode": "grid", "dp": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, "zero": 0,
                "micro_batches": 1,
                "schedule": "1f1b", "chunks_per_rank": 1, "sequence_parallel": False}


def generation_config(meta: dict, overrides: dict) -> Config:
    """The config of a generation launch: the checkpoint's (``meta["config"]``) with the
    layout of ``_ONE_PROCESS``, then ``overrides`` (``{"parallel.tp": 2, ...}``), the batch
    set to one sequence per replica, no Hugging Face source (the checkpoint holds the
    weights). ``ConfigError`` (one line) when it is invalid."""
    if "config" not in meta or "tokenizer" not in meta:
        raise ConfigError("the checkpoint is not a language model's (no config or tokenizer)")
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in meta["config"].items()}
    data["parallel"] = {**data.get("parallel", {}), **_ONE_PROCESS}
    data["model"] = {**data.get("model", {}), "init_from": ""}
    data["training"] = {**data.get("training", {}), "compile": False}
    for dotted, value in overrides.items():  # "parallel.tp" -> data["parallel"]["tp"]
        *heads, last = dotted.split(".")
        node = data
        for h in heads:
            node = node.setdefault(h, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--{dotted}: {h!r} is not a section")
        node[last] = value
    from shardwise.training.rundir import MODEL_SHAPE_FIELDS

    saved = meta["config"].get("model", {}) if isinstance(meta["config"], dict) else {}
    for name in MODEL_SHAPE_FIELDS:  # the checkpoint's tensors have the checkpoint's shapes
        given = overrides.get(f"model.{name}")
        if f"model.{name}" in overrides and name in saved and given != saved[name]:
            raise ConfigError(f"model.{name}={given!r}: the checkpoint's model has "
                              f"model.{name}={saved[name]!r}; generation runs the "
                              "checkpoint's model")
    p = data["parallel"]
    data["training"]["global_batch_size"] = int(p.get("dp", 1)) * int(p.get("micro_batches", 1))
    return Config.from_dict(data)


def generate_rank(cfg_dict: dict, path: str, prompt: list[int], new_tokens: int,
                  temperature: float, top_k: int | None, seed: int) -> list[int]:
    """This rank's part of sampling ``new_tokens`` ids after ``prompt`` from the checkpoint
    at ``path`` (see the module docstring); returns the whole sequence (prompt included),
    the same on every rank. Expects ``torch.distributed`` initialised with ``cfg.world_size``
    ranks, or no process group for one process."""
    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    distributed = dist.is_initialized()
    if distributed:
        comm.configure(timeout_s=p.timeout_s)
        topology = init_process_groups(Topology.build(p.dp, p.pp, p.tp, cp=p.cp, ep=p.ep,
                                                      dp_replicate=p.dp_replicate,
                                                      rank=dist.get_rank(),
                                                      world_size=dist.get_world_size()))
    else:
        topology = Topology.build(p.dp, p.pp, p.tp, cp=p.cp, ep=p.ep,
                                  dp_replicate=p.dp_replicate)
    device = torch.device("cpu")
    if distributed and dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    meta = checkpoint.read_meta(path)
    tokenizer = tokenizer_from_state(meta["tokenizer"])
    d = describe_section(cfg.model, tokenizer.vocab_size)
    # generation masks no documents (a prompt is one); the id only lets a block_causal
    # model's engine be built
    engine = Engine(d, topology, EngineConfig.of(
        cfg, eos_id=getattr(tokenizer, "eos_id", None)), device)
    with engine.full_parameters():  # the weights and routing biases, not AdamW's state
        targets = {k: v for k, v in engine_state.logical_tensors(engine, targets=True).items()
                   if k != "optimizer"}
    # each rank reads its own slices; the launcher verified the checksums (check_loadable)
    checkpoint.load(Path(path), targets, verified=True)
    engine_state.load_logical_tensors(engine, targets)
    g = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    with engine.full_parameters():
        out = engine.generate(idx, new_tokens, generator=g, vocab_size=tokenizer.vocab_size,
                              temperature=temperature, top_k=top_k)
    return out[0].tolist()
