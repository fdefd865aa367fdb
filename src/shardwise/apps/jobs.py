"""Per-rank entry point of ``shardwise train`` (run inside each spawned or torchrun rank)."""

from __future__ import annotations

import torch

from shardwise.apps.registry import app_for
from shardwise.base.config import Config


def train_worker(cfg_dict: dict, resume: bool | str = False, device_str: str | None = None) -> dict:
    """Run this rank of the application ``cfg_dict`` selects (``apps.registry.app_for``);
    returns its ``train_rank``'s summary. A module-level function, so the local launcher can
    pickle it.

    ``resume``: a checkpoint path (the launcher chose and verified it), ``True`` for the
    newest usable one of ``checkpoint_dir``, or ``False``. Expects ``torch.distributed`` to
    be initialised with ``cfg.world_size`` ranks; ``device_str``: this rank's device ("cuda":
    the current CUDA device, which ``init_distributed`` set; None: the application's default).
    """
    import torch.distributed as dist

    from shardwise.base.topology import Topology
    from shardwise.launch import name_rank, rank_device, rank_title

    cfg = Config.from_dict(cfg_dict)
    if cfg.uses_grid and dist.is_initialized():  # ps: shardwise rank 3 (dp 1, tp 1, pp 0)
        p = cfg.parallel
        grid = Topology(dp=p.dp, pp=p.pp, tp=p.tp, cp=p.cp)
        name_rank(rank_title(dist.get_rank(), grid.coords_of(dist.get_rank())))
    app = app_for(cfg)
    device = None
    if device_str:
        device = rank_device("cuda") if device_str == "cuda" else torch.device(device_str)
    return app.train_rank(cfg_dict, device, resume)
