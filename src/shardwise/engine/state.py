"""The engine's tensors in a checkpoint: model, optimizer pieces, random streams.

- ``model``: this rank's parameters under the single-process GPT's names, unsharded over tp
  (and gathered under ZeRO-3); a tied head's copy is not listed (the GPT lists the
  embedding only). Every rank of a stage writes the same tensors; DCP keeps one.
- ``optimizer``: one entry per master piece, ``{"step", "exp_avg", "exp_avg_sq",
  "master"}``. Whole parameters (ZeRO-0) are keyed by their name and stored unsharded over
  tp, so they load into any tp or dp size; ZeRO pieces are keyed ``name[a:b]`` (plus
  ``@tpR`` for a tp-sharded parameter) and load into the same layout.
- ``rng``: per global rank, the CPU (and CUDA) generator and the tensor-parallel dropout
  stream.

Restoring loads the masters and the moments; ``sync.after_step()`` then rebuilds the
compute-dtype parameters from the masters, as after an optimizer step.
"""

from __future__ import annotations

import torch


def _key(engine, i: int) -> tuple[str, bool]:
    """Checkpoint key of piece ``i`` and whether it is a whole parameter (stored unsharded)."""
    sync = engine.sync
    name, p, m = sync.piece_names[i], sync.piece_params[i], sync.pieces[i]
    whole = m.numel() == p.numel() and "[" not in name
    if not whole and getattr(p, "tp_dim", None) is not None and engine.tp.size > 1:
        name = f"{name}@tp{engine.tp.rank}"
    return name, whole


def model_tensors(engine) -> dict[str, torch.Tensor]:
    """Full tensors of this rank's parameters (collective over tp; call inside
    ``engine.full_parameters()`` under ZeRO-3)."""
    local = engine.local
    skip = {"head.proj.weight"} if "head.proj.weight" in local.tied else set()
    return {n: local.full_tensor(n, p, p.detach()) for n, p in local.named_parameters()
            if n not in skip}


def optimizer_tensors(engine) -> dict[str, dict]:
    """``{key: {"step", "exp_avg", "exp_avg_sq", "master"}}`` for every piece (collective
    over tp for whole tp-sharded parameters). Pieces not stepped yet get zero moments, so
    that a load has a target."""
    out, sync, local = {}, engine.sync, engine.local
    state = engine.optimizer.optimizer.state
    for i, m in enumerate(sync.pieces):
        key, whole = _key(engine, i)
        st = state.get(m) or {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(m),
                              "exp_avg_sq": torch.zeros_like(m)}
        entry = {"step": st["step"], "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"],
                 "master": m.detach()}
        if whole:  # unsharded over tp: loadable at any tp size
            name, p = sync.piece_names[i], sync.piece_params[i]
            entry = {k: (local.full_tensor(name, p, v) if v.dim() > 0 else v.clone())
                     for k, v in entry.items()}
        out[key] = entry
    return out


@torch.no_grad()
def load_optimizer_tensors(engine, loaded: dict[str, dict]) -> None:
    """Inverse of ``optimizer_tensors`` (``loaded`` as DCP filled it): masters copied into
    the pieces, moments into AdamW's state, then the parameters rebuilt from the masters."""
    sync, local = engine.sync, engine.local
    state = engine.optimizer.optimizer.state
    for i, m in enumerate(sync.pieces):
        key, whole = _key(engine, i)
        entry = loaded[key]
        if whole:
            name, p = sync.piece_names[i], sync.piece_params[i]
            entry = {k: (local.local_tensor(name, p, v) if v.dim() > 0 else v)
                     for k, v in entry.items()}
        m.copy_(entry["master"].to(m.dtype))
        if float(entry["step"]) > 0:
            state[m] = {"step": entry["step"].detach().clone().float().cpu(),
                        "exp_avg": entry["exp_avg"].to(m.device, m.dtype).clone(),
                        "exp_avg_sq": entry["exp_avg_sq"].to(m.device, m.dtype).clone()}
    sync.after_step()


def rng_tensors(engine) -> dict[str, torch.Tensor]:
    """This rank's random streams: CPU, CUDA (on a GPU) and the tp dropout stream."""
    out = {"cpu": torch.get_rng_state()}
    if engine.device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(engine.device)
    if engine.local.rng is not None:
        out["tp"] = engine.local.rng.state
    return out


def load_rng_tensors(engine, rng: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and engine.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], engine.device)
    if "tp" in rng and engine.local.rng is not None:
        engine.local.rng.state = rng["tp"].clone()
