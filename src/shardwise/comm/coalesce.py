"""One collective over many tensors: flatten, run it once, copy the result back.

The pattern of torch's ``_flatten_dense_tensors`` / ``_unflatten_dense_tensors`` (and of
Megatron's and DeepSpeed's coalesced all-reduce): many small messages cost one latency
each, one concatenated message costs one latency in all.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


@torch.no_grad()
def coalesced_(tensors: Sequence[torch.Tensor], op: Callable[[torch.Tensor], object]) -> None:
    """Run ``op`` once, in place, on the concatenation of ``tensors`` and copy each tensor's
    slice of the result back into it (in place).

    ``tensors``: any shapes, one dtype and device (``torch.cat``'s rule; a ``RuntimeError``
    otherwise). ``op(flat)``: ``flat`` is 1-d, ``sum(t.numel())`` elements, in the order
    given; ``op`` must leave its result in ``flat`` (``comm.all_reduce`` does); its return
    value is ignored. Nothing is done for an empty list.
    """
    if not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    op(flat)
    off = 0
    for t in tensors:
        t.copy_(flat[off:off + t.numel()].view_as(t))
        off += t.numel()
