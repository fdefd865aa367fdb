"""Per-rank entry points of the CLI's jobs (run inside each spawned or torchrun rank)."""

from __future__ import annotations

import torch.distributed as dist

from shardwise import checkpoint, comm
from shardwise.config import Config
from shardwise.data import CharTokenizer
from shardwise.topology import Topology, init_process_groups
import torch

from shardwise.trainer import describe_layout


def train_worker(cfg_dict: dict, resume: bool = False, device_str: str | None = None) -> dict:
    """Build topology and trainer on this rank, train, write outputs; returns the summary.

    Expects ``torch.distributed`` to be initialised with ``dp * pp * tp`` ranks.
    """
    import torch

    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    comm.configure(timeout_s=p.timeout_s)  # a missing peer raises, naming the collective
    topology = init_process_groups(Topology.build(p.dp, p.pp, p.tp, rank=dist.get_rank(),
                                                  world_size=dist.get_world_size()))
    device = torch.device(device_str) if device_str else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
    tokenizer = None
    latest = checkpoint.latest_checkpoint(cfg.checkpoint_dir) if resume else None
    if latest is not None:
        tokenizer = CharTokenizer.from_state_dict(checkpoint.read_meta(latest)["tokenizer"])
    from shardwise.trainer import Trainer

    trainer = Trainer(cfg, topology, device, tokenizer=tokenizer)
    if topology.rank == 0:
        n = _full_size(trainer.gpt_cfg)
        print(f"shardwise: GPT {n / 1e6:.2f}M parameters, vocab {trainer.tokenizer.vocab_size}, "
              f"{len(trainer.train_tokens):,} train / {len(trainer.val_tokens):,} val chars; "
              f"{describe_layout(cfg)}, {torch.get_num_threads()} threads per rank", flush=True)
    if latest is not None:
        trainer.resume(latest)
        if topology.rank == 0:
            print(f"shardwise: resumed from {latest} at step {trainer.step}", flush=True)
    summary = trainer.fit()
    trainer.finish()
    return summary


def _full_size(cfg) -> int:
    """Parameters of the single-process GPT (what every layout trains), counted on the meta
    device: nothing is allocated."""
    from shardwise.models import GPT

    with torch.device("meta"):
        return GPT(cfg).num_parameters()
