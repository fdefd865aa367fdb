"""Per-rank entry points of the CLI's jobs (run inside each spawned or torchrun rank)."""

from __future__ import annotations

import torch.distributed as dist

from shardwise import checkpoint, comm
from shardwise.config import Config
from shardwise.data import CharTokenizer
from shardwise.topology import Topology, init_process_groups


def train_worker(cfg_dict: dict, resume: bool = False, device_str: str | None = None) -> dict:
    """Build topology and trainer on this rank, train, write outputs; returns the summary.

    Expects ``torch.distributed`` to be initialised with ``dp * pp * tp`` ranks
    (``ps.servers + ps.workers`` with ``parallel.mode = "ps"``: see ``param_server``).
    """
    import torch

    cfg = Config.from_dict(cfg_dict)
    if cfg.parallel.mode == "ps":  # servers and workers instead of the rank grid
        from shardwise.param_server import train_rank

        return train_rank(cfg_dict, torch.device(device_str) if device_str else None, resume)
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
        n = trainer.model.num_parameters()
        print(f"shardwise: GPT {n / 1e6:.2f}M parameters, vocab {trainer.tokenizer.vocab_size}, "
              f"{len(trainer.train_tokens):,} train / {len(trainer.val_tokens):,} val chars; "
              f"{_layout(cfg, topology)}, {torch.get_num_threads()} threads per rank", flush=True)
    if latest is not None:
        trainer.resume(latest)
        if topology.rank == 0:
            print(f"shardwise: resumed from {latest} at step {trainer.step}", flush=True)
    summary = trainer.fit()
    trainer.finish()
    return summary


def _layout(cfg, topology) -> str:
    """``dp=2`` / ``dp=1 x pp=2 (pipedream, m=4)`` / ``dp=2 x tp=2``, plus ZeRO."""
    parts = [f"dp={topology.dp}"]
    p = cfg.parallel
    if topology.pp > 1:
        parts.append(f"pp={topology.pp} ({p.schedule}, m={p.micro_batches})")
    if topology.tp > 1:
        parts.append(f"tp={topology.tp}")
    zero = f", ZeRO-{p.zero}" if p.zero else ""
    return " x ".join(parts) + zero
