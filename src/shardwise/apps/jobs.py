"""Per-rank entry points of the CLI's jobs (run inside each spawned or torchrun rank)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from shardwise import checkpoint, comm
from shardwise.comm import check as comm_check
from shardwise.base.config import Config
from shardwise.data import CharTokenizer
from shardwise.base.topology import Topology, init_process_groups
from shardwise.training.trainer import describe_layout


def train_worker(cfg_dict: dict, resume: bool | str = False, device_str: str | None = None) -> dict:
    """Build topology and trainer on this rank, train, write outputs; returns the summary.

    ``resume``: a checkpoint path (the launcher chose and verified it), ``True`` for the
    newest usable one of ``checkpoint_dir``, or ``False``. Expects ``torch.distributed`` to
    be initialised with ``dp * pp * tp`` ranks (``ps.servers + ps.workers`` with
    ``parallel.mode = "ps"``: see ``param_server``).
    """
    cfg = Config.from_dict(cfg_dict)
    if cfg.model.kind == "cnn":  # the CNN with a per-layer plan over cnn.ranks ranks
        from shardwise.apps.cnn.training import train_rank as train_cnn

        return train_cnn(cfg_dict, torch.device(device_str) if device_str else None, resume)
    if cfg.parallel.mode == "ps":  # servers and workers instead of the rank grid
        from shardwise.apps.param_server import train_rank

        return train_rank(cfg_dict, torch.device(device_str) if device_str else None, resume)
    p = cfg.parallel
    comm.configure(timeout_s=p.timeout_s)  # a missing peer raises, naming the collective
    topology = init_process_groups(Topology.build(p.dp, p.pp, p.tp, rank=dist.get_rank(),
                                                  world_size=dist.get_world_size()))
    # the device of the process group's backend: CUDA with NCCL, else the CPU
    device = torch.device(device_str) if device_str else comm_check.group_device(None)
    tokenizer = None
    if isinstance(resume, str):
        latest = Path(resume)
    else:
        latest = checkpoint.find_resumable(cfg.checkpoint_dir)[0] if resume else None
    if latest is not None:
        tokenizer = CharTokenizer.from_state_dict(checkpoint.read_meta(latest)["tokenizer"])
    from shardwise.training.trainer import Trainer

    trainer = Trainer(cfg, topology, device, tokenizer=tokenizer)
    if topology.rank == 0:
        n = _full_size(trainer.gpt_cfg)
        print(f"shardwise: GPT {n / 1e6:.2f}M parameters, vocab {trainer.tokenizer.vocab_size}, "
              f"{len(trainer.train_tokens):,} train / {len(trainer.val_tokens):,} val chars; "
              f"{describe_layout(cfg)}, {_where(device)}, {torch.get_num_threads()} threads "
              "per rank", flush=True)
        mem = trainer.engine.memory_bytes()
        print(f"shardwise: rank 0 holds {_mib(mem['params'])} parameters, {_mib(mem['grads'])} "
              f"gradients, {_mib(mem['optimizer'])} optimizer state "
              f"({_mib(mem['total'])}; `shardwise memory` predicts every layout)", flush=True)
    if latest is not None:
        trainer.resume(latest)
        if topology.rank == 0:
            print(f"shardwise: resumed from {latest} at step {trainer.step} "
                  "(--fresh starts over, keeping the old checkpoints)", flush=True)
    summary = trainer.fit()
    trainer.wait_for_checkpoint()  # checkpoint.async_save: the last one is complete
    trainer.finish()
    return summary


def _where(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _full_size(cfg) -> int:
    """Parameters of the single-process GPT (what every layout trains), counted on the meta
    device: nothing is allocated."""
    from shardwise.models import GPT

    with torch.device("meta"):
        return GPT(cfg).num_parameters()
