"""The engine's tensors in a checkpoint, in a layout-independent (logical) form.

A checkpoint holds what one process training the same model would hold, whatever the
layout that wrote it (dp, cp, tp, pp, ZeRO stage, precision; cp ranks are replicas of the
weights, so ZeRO's pieces are spread over dp x cp and joined over it):

- ``model.NAME``: the fp32 master of parameter ``NAME`` (the single-process model's names
  and shapes: unsharded over tp, vocabulary padding dropped, ZeRO pieces joined);
- ``optimizer.NAME.{exp_avg, exp_avg_sq}``: AdamW's moments, the same shapes, fp32;
  ``optimizer.NAME.step``: its step count (a 0-dim tensor);
- ``buffers.NAME``: training state kept in buffers (``LocalModel.named_buffers``: a mixture
  of experts' ``expert_bias`` (E,) fp32), present only when the model has such; every rank
  holds the whole of each of its stage's (the router is replicated over tp and ep), and
  writes or reads it whole.

A tied head is not listed (the model lists the embedding only); at pp > 1 the last stage's
copy of it is loaded from the embedding's entries. Random streams are not stored: the
engine reseeds its dropout streams from ``(seed, step, coordinates)`` before every step
(``Engine.train_step``), so a run resumed at step k in any layout draws, from k on, the
masks of an uninterrupted run in that layout (its weights at k are the saved run's, which
with dropout differ from that run's own when the saving layout's coordinates differ). The sampler's position is global (epoch, batch) in the trainer's meta.

Saving (``logical_tensors``): each rank writes its pieces into zeroed flat buffers shaped
like its tp-local parameters; under ZeRO one all-reduce (sum) over dp joins the disjoint
pieces. A tp-sharded tensor is then offered to DCP as a ``DTensor`` over the tp group
(``Shard(tp_dim)``, vocabulary padding cut off, which is ``torch.chunk``'s uneven split):
each tp rank writes its own slice as one chunk of the logical tensor. Replicated tensors
are offered whole by every rank that holds them, and DCP's save planner keeps one writer
per tensor or chunk (``dedup_save_plans`` spreads them over the ranks by size), so the dp
replicas split the writing and nothing is written twice. Loading
(``load_logical_tensors``) is the inverse, with no communication of ours: DCP reads, for
each rank, the parts of the saved chunks that overlap its slice (its planner reshards),
and each rank keeps its ZeRO ranges. ZeRO pieces are joined over dp rather than written
as chunks because a piece is a flat range of a tp slice, which is not a box of the
logical tensor, and DCP describes chunks as boxes (offsets and sizes per dim).

Expert parameters under expert parallelism (``ep_dim``: each ep rank holds E / ep of the
experts) are stored under the same single-process names and shapes, (E, ...): a ``DTensor``
sharded along the experts over the ep group (``Shard(0)``), and along ``tp_dim`` too on a
two-dimensional (ep, tp) mesh when tp > 1; their ZeRO pieces are joined over the
``ep_dp_cp`` group, the ranks that hold the same experts (``ep_dp``, times cp). So a
checkpoint written at one ep (or cp) loads at any other (DCP reads each rank's experts from
whichever chunks hold them).
"""

from __future__ import annotations

import re

import torch
from torch.distributed.tensor import DTensor, Shard

from shardwise import comm
from shardwise.comm.coalesce import coalesced_
from shardwise.parallel.experts import is_expert

FORMAT = 2  # meta["format"]: 2 = logical tensors (this module); absent = per-piece keys
_PIECE = re.compile(r"^(?P<name>.+)\[(?P<a>\d+):(?P<b>\d+)\]$")


def model_tensors(engine) -> dict[str, torch.Tensor]:
    """Full compute-dtype tensors of this rank's parameters (collective over tp; call
    inside ``engine.full_parameters()`` under ZeRO-3). For tests and reports."""
    local = engine.local
    tied = local.description.tied
    skip = {tied[1]} if tied is not None and tied[1] in local.tied else set()
    return {n: local.full_tensor(n, p, p.detach()) for n, p in local.named_parameters()
            if n not in skip}


def _pieces_by_param(engine) -> dict[str, list[tuple[int, int, int]]]:
    """Parameter name -> ``(piece index, start, end)`` of each master piece in its flat
    (tp-local) parameter: whole parameters (ZeRO-0) are ``name``, ZeRO pieces ``name[a:b]``."""
    sync = engine.sync
    out: dict[str, list[tuple[int, int, int]]] = {}
    for i, (key, p) in enumerate(zip(sync.piece_names, sync.piece_params)):
        m = _PIECE.match(key)
        name, a, b = (m["name"], int(m["a"]), int(m["b"])) if m else (key, 0, p.numel())
        out.setdefault(name, []).append((i, a, b))
    return out


def _zero_sharded(engine) -> bool:
    return engine.cfg.parallel.zero > 0 and engine.distributed and engine.topology.dp_cp > 1


def _key(engine, name: str) -> str:
    """Checkpoint name of local parameter ``name`` (the tied head copy: the embedding's)."""
    tied = engine.local.description.tied
    return tied[0] if tied is not None and name == tied[1] and name in engine.local.tied else name


@torch.no_grad()
def logical_tensors(engine, targets: bool = False, joined: bool = True) -> dict[str, dict]:
    """``{"model": {name: fp32}, "optimizer": {name: {"exp_avg", "exp_avg_sq", "step"}}}``
    (and ``"buffers": {name: tensor}`` when the stage holds training-state buffers,
    ``LocalModel.named_buffers``) for this rank's stage, on the CPU, logical shapes (``DTensor`` slices for tp-sharded
    parameters; see module docstring), fresh copies that later steps do not change.
    Collective over dp x cp under ZeRO. Parameters not stepped yet get zero moments and step 0.
    ``targets``: for a load, list the tied head copy too (under the embedding's name).
    ``joined=False``: no communication, and no ``full_parameters()`` needed: the ZeRO pieces
    other ranks hold are left zero, and so are the moments' steps of what this rank holds
    none of; the rank of the same coordinates in a job of the same layout reads back exactly
    this rank's (a fault-tolerant heal, whose ranks of one job may copy from different
    peers)."""
    local, sync = engine.local, engine.sync
    state = engine.optimizer.optimizer.state
    by_param = _pieces_by_param(engine)
    named = local.named_parameters()
    dev = engine.device
    bufs = [torch.zeros(3, p.numel(), dtype=torch.float32, device=dev) for _, p in named]
    steps = torch.zeros(len(named), dtype=torch.float64, device=dev)
    for j, (n, p) in enumerate(named):
        for i, a, b in by_param.get(n, []):
            m = sync.pieces[i]
            bufs[j][0, a:b] = m.detach().reshape(-1)
            st = state.get(m)
            if st:
                bufs[j][1, a:b] = st["exp_avg"].reshape(-1)
                bufs[j][2, a:b] = st["exp_avg_sq"].reshape(-1)
                steps[j] = float(st["step"])
    if joined and _zero_sharded(engine) and bufs:  # disjoint ranges over dp x cp: a sum joins
        split = _ep_split(engine)
        expert = [split and is_expert(p) for _, p in named]
        _join([b for b, e in zip(bufs, expert) if not e], engine.shard_group)
        if split:  # ZeRO shards expert parameters over the ranks holding them, ep_dp x cp
            _join([b for b, e in zip(bufs, expert) if e], engine.topology.groups.ep_dp_cp)
        comm.all_reduce(steps, op="max", group=engine.shard_group, check=False)
    model, optim = {}, {}
    for j, (n, p) in enumerate(named):
        key = _key(engine, n)
        if key != n and not targets:  # the tied head copy: stored once, as the embedding
            continue                  # (the two are bitwise equal)
        model[key], moment1, moment2 = (_logical(engine, n, p, bufs[j][k].view(p.shape))
                                        for k in range(3))
        optim[key] = {"exp_avg": moment1, "exp_avg_sq": moment2,
                      "step": torch.tensor(float(steps[j]), dtype=torch.float32)}
    out = {"model": model, "optimizer": optim}
    buffers = {n: b.detach().cpu().clone() for n, b in local.named_buffers()}
    if buffers:  # training state (a mixture of experts' expert_bias), replicated
        out["buffers"] = buffers
    return out


def _sharded(engine, p) -> bool:
    return engine.distributed and engine.tp.size > 1 and getattr(p, "tp_dim", None) is not None


def _ep_sharded(engine, p) -> bool:
    return engine.distributed and engine.ep.size > 1 and is_expert(p)


def _join(bufs: list[torch.Tensor], group) -> None:
    """Sum ``bufs`` over ``group`` in place, one all-reduce (nothing for an empty list): the
    ranks' zero-filled buffers, each holding its disjoint ZeRO pieces, become whole."""
    coalesced_(bufs, lambda flat: comm.all_reduce(flat, group=group, check=False))


def _ep_split(engine) -> bool:
    """Whether expert parameters are synced apart, over ep_dp x cp (expert parallelism)."""
    return engine.distributed and engine.ep.size > 1


def _mesh(engine, axes: tuple[str, ...] = ("tp",)):
    """A ``DeviceMesh`` over the tp group, the ep group, or both (ep rows, tp columns: the
    global ranks of this rank's ep group, each with its tp group), made once per engine
    (no collective)."""
    cache = engine.__dict__.setdefault("_checkpoint_meshes", {})
    if axes not in cache:
        from torch.distributed.device_mesh import DeviceMesh

        groups = {"tp": engine.tp.group, "ep": engine.ep.group}
        if len(axes) == 1:
            cache[axes] = DeviceMesh.from_group(groups[axes[0]], "cpu")
        else:
            topo = engine.topology
            grid = [topo.axis_ranks("tp", r) for r in topo.ep_ranks()]
            cache[axes] = DeviceMesh.from_group([groups[a] for a in axes], "cpu",
                                                mesh=torch.tensor(grid), mesh_dim_names=axes)
    return cache[axes]


def _logical(engine, name: str, p, local: torch.Tensor) -> torch.Tensor:
    """``local`` (shaped like the local ``p``) as a tensor of the logical shape on the CPU:
    a ``DTensor`` holding this rank's slice when ``p`` is tp-sharded or an expert parameter
    under ep, else a copy."""
    tp_split, ep_split = _sharded(engine, p), _ep_sharded(engine, p)
    if not (tp_split or ep_split):
        return local.detach().cpu().clone()
    shape, axes, placements = list(local.shape), (), []
    if ep_split:
        shape[p.ep_dim] *= engine.ep.size
        axes, placements = ("ep",), [Shard(p.ep_dim)]
    if tp_split:
        d, tp = p.tp_dim, engine.tp
        shape[d] *= tp.size
        axes, placements = axes + ("tp",), placements + [Shard(d)]
        if name in engine.local.vocab_params:  # padded rows: the logical tensor has V
            shape[0] = engine.description.vocab_size
            local = local[:max(0, min(local.shape[0], shape[0] - tp.rank * local.shape[0]))]
    local = local.detach().cpu().contiguous().clone()
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, _mesh(engine, axes), placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)


def _tp_local(engine, name: str, p, t: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_logical``: the tensor shaped like ``p`` (vocabulary padding added back
    as zeros, as ``tensor_parallel.state.shard_like`` does)."""
    if not isinstance(t, DTensor):
        return engine.local.local_tensor(name, p, t)
    x = t.to_local()
    if x.shape[0] < p.shape[0]:
        x = torch.cat([x, x.new_zeros((p.shape[0] - x.shape[0],) + tuple(x.shape[1:]))])
    return x


@torch.no_grad()
def load_logical_tensors(engine, loaded: dict[str, dict]) -> None:
    """Inverse of ``logical_tensors`` (``loaded`` as DCP filled it): each rank copies its
    tp slice and ZeRO ranges into its masters and AdamW's state, then the compute-dtype
    parameters are rebuilt from the masters (``sync.after_step``). No communication.
    Without ``loaded["optimizer"]`` (the weights only: ``shardwise generate``) AdamW's state
    is left as it is."""
    local, sync = engine.local, engine.sync
    state = engine.optimizer.optimizer.state
    # AdamW keeps ``step`` on the CPU, except the fused kernel, which reads it on the device
    fused = bool(engine.optimizer.optimizer.defaults.get("fused"))
    by_param = _pieces_by_param(engine)
    for n, p in local.named_parameters():
        key = _key(engine, n)
        opt = loaded.get("optimizer", {}).get(key)
        mine = [_tp_local(engine, n, p, t).reshape(-1)
                for t in (loaded["model"][key],) + ((opt["exp_avg"], opt["exp_avg_sq"])
                                                   if opt is not None else ())]
        step = float(opt["step"]) if opt is not None else 0.0
        for i, a, b in by_param.get(n, []):
            m = sync.pieces[i]
            m.copy_(mine[0][a:b].view_as(m))
            if opt is None:
                continue
            state.pop(m, None)
            if step > 0:
                state[m] = {"step": torch.tensor(step, dtype=torch.float32,
                                                 device=m.device if fused else "cpu"),
                            "exp_avg": mine[1][a:b].to(m.device).view_as(m).clone(),
                            "exp_avg_sq": mine[2][a:b].to(m.device).view_as(m).clone()}
    saved = loaded.get("buffers", {})
    for n, b in local.named_buffers():  # replicated: every rank holding the layer reads it
        if n in saved:  # absent: a state the saving model had not (left as built: zeros)
            b.copy_(saved[n])
    sync.after_step()


def local_slices(tree):
    """``tree`` (nested dicts of tensors, as ``logical_tensors`` returns) with each
    ``DTensor`` replaced by its local slice: what travels between two ranks of the same
    coordinates in two jobs of the same layout (a fault-tolerant heal), no mesh pickled."""
    if isinstance(tree, dict):
        return {k: local_slices(v) for k, v in tree.items()}
    return tree.to_local() if isinstance(tree, DTensor) else tree


def as_logical(tree, like):
    """Inverse of ``local_slices`` on the receiving rank: each entry whose counterpart in
    ``like`` (this rank's ``logical_tensors(engine, targets=True)``) is a ``DTensor`` wrapped
    as one, on that mesh and placement."""
    if isinstance(tree, dict):
        return {k: as_logical(v, like.get(k) if isinstance(like, dict) else None)
                for k, v in tree.items()}
    if isinstance(like, DTensor):
        return DTensor.from_local(tree, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())
    return tree
