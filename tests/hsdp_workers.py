"""Rank function for the HSDP tests: parity layouts and a resume across (R, S), one spawn.

``hsdp_worker(configs, jobs)``: every config trained as ``layout_workers.run_layout`` does
(losses, unsharded parameters, bytes held), then every checkpoint job as
``reshard_workers`` runs it (save, resume), in the order given.
"""

from __future__ import annotations

import torch


def hsdp_worker(configs: list[dict], jobs: list[dict]) -> tuple[list[dict], list[dict]]:
    from layout_workers import run_layout
    from reshard_workers import _job

    torch.set_num_threads(1)
    return [run_layout(c) for c in configs], [_job(j) for j in jobs]
