"""Bytes per rank for parameters, gradients and optimizer states: formula vs measurement.

The formulas are those of Rajbhandari et al. (SC 2020, section 3) with mixed-precision Adam,
K = 12 bytes of fp32 optimizer state per parameter (master weight, momentum, variance) and
b bytes per compute-dtype value (2 for bf16/fp16, 4 for fp32):

    stage 0 (DDP)   b*P      + b*P      + 12*P      (16P with b = 2)
    stage 1         b*P      + b*P      + 12*P/N    (4P + 12P/N)
    stage 2         b*P      + b*P/N    + 12*P/N    (2P + 14P/N)
    stage 3         b*P/N    + b*P/N    + 12*P/N    (16P/N)

P is the padded parameter count (each bucket or unit padded to a multiple of N). Two
things of this implementation are stated rather than hidden: Adam moments exist only for
real elements, so a rank's optimizer bytes are 8 bytes per padding element it owns below
the formula; and in fp32 stage 3 the gathered shard is the master itself, so the
parameter term is 0 there. The measurement walks the tensors a rank really holds (model
parameters and gradients, the wrapper's shards, the optimizer's state), counting each
storage once.
"""

from __future__ import annotations

import torch

K_ADAM = 12


def predicted_bytes(padded_numel: int, world_size: int, stage: int, param_bytes: int) -> dict:
    """Formula bytes per rank: ``{"params", "grads", "optimizer", "total"}``."""
    P, N, b = padded_numel, world_size, param_bytes
    params = b * P // N if stage == 3 else b * P
    if stage == 3 and b == 4:
        params = 0  # fp32: the master shard is what forward gathers
    grads = b * P // N if stage >= 2 else b * P
    optimizer = K_ADAM * P // N if stage >= 1 else K_ADAM * P
    return {"params": params, "grads": grads, "optimizer": optimizer,
            "total": params + grads + optimizer}


def storage_bytes_once(seen: set, t: torch.Tensor | None) -> int:
    """Bytes of ``t``'s storage, or 0 if that storage is in ``seen`` (then it is added), is
    empty, or ``t`` is None: summing it over tensors counts each storage once (views of one
    flat buffer, a bucket and the gradients in it)."""
    if t is None:
        return 0
    st = t.untyped_storage()
    key = st.data_ptr()
    if st.nbytes() == 0 or key in seen:
        return 0
    seen.add(key)
    return st.nbytes()


def measured_bytes(model: torch.nn.Module, wrapper, optimizer) -> dict:
    """Bytes this rank holds now, by category, each storage counted once."""
    seen: set = set()
    params = sum(storage_bytes_once(seen, p) for p in model.parameters())
    params += sum(storage_bytes_once(seen, t) for t in wrapper.param_shards())
    optim = sum(storage_bytes_once(seen, m) for m in wrapper.pieces)  # fp32 masters
    for state in optimizer.state.values():
        optim += sum(storage_bytes_once(seen, state.get(k)) for k in ("exp_avg", "exp_avg_sq"))
    grads = sum(storage_bytes_once(seen, p.grad) for p in model.parameters())
    grads += sum(storage_bytes_once(seen, g) for g in wrapper.grad_shards())
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


def report(model, wrapper, optimizer, stage: int) -> dict:
    """Predicted and measured bytes for this rank, with the padding stated."""
    b = next(model.parameters()).element_size()
    n = wrapper.world_size
    pad_mine = wrapper.shard_numel - sum(m.numel() for m in wrapper.pieces)
    return {"stage": stage, "world_size": n, "param_bytes": b, "numel": wrapper.numel,
            "padded_numel": wrapper.padded_numel, "padding_owned": pad_mine,
            "predicted": predicted_bytes(wrapper.padded_numel, n, stage, b),
            "measured": measured_bytes(model, wrapper, optimizer)}
