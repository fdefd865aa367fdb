"""ZeRO stage 3: parameters live sharded and are gathered per unit just when needed.

Rajbhandari et al., SC 2020, stage P_os+g+p; the unit-by-unit gather follows the shape of
PyTorch FSDP (Zhao et al., VLDB 2023). The model is cut into *units* (for the GPT: the
embedding, each block, the head; parameters shared by two units, like tied embeddings, go
to a root unit that stays gathered for the whole step). Per unit, the parameters are one
flat buffer padded to N; each rank keeps only its 1/N shard (the fp32 master).

- forward: before a unit runs, its flat buffer is all-gathered into the parameters'
  storage and the next unit's gather is launched (prefetch, overlapping this unit's
  compute); after it runs the storage is freed (resized to 0 bytes).
- backward: a hook on the unit's output gathers the unit again just before its backward
  (and prefetches the unit before it); when every parameter of the unit has its
  gradient, the gradients are packed, reduce-scattered into the shard (asynchronously),
  and both the full gradients and the parameters are freed.
- gradient accumulation: full gradients are never kept, so every micro-batch is
  reduce-scattered and summed into the shard; ``no_sync`` is accepted and changes nothing.
  A pipeline stage (``parallel.pp > 1``) is the same: its units are gathered again for each
  micro-batch's forward and for its backward (from the hook on that micro-batch's output).
  With the interleaved schedule the engine wraps each of a rank's chunks in a ZeroStage3 of
  its own, so a chunk's backward gathers, reduce-scatters and waits on its units alone.

HSDP (``replicas``, a ``comm.replicas.Replicas``): ``group`` is one replica's shard group;
at ``finish`` (once per step, after every micro-batch's reduce-scatter) the dense gradient
shards are averaged across the replicas (the mean is linear, so once per step equals once
per micro-batch). Expert units keep their own group, which spans the replicas.

Offload (``training.offload``): ``offload`` keeps the fp32 master shards (and so AdamW's
moments and step) in host memory; ``offload_params`` (``"optimizer+params"``) the
compute-dtype shard that is gathered too, so between uses the device holds only the gradient
shards: each gather first copies the shard to the device (``offload.Transfers``; on CUDA a
side stream, the compute stream waiting on it), the step's gradients go to the host
(``fp32_step``), and ``refresh_params`` casts the stepped masters into the host shards.

Autograd keeps references to the parameters it saved in forward; the storage they point
to is refilled before the unit's backward, and writing through the flat buffer does not
touch the parameters' own version counters, so this is safe.

Compiled units (``training.compile``, ``nn.Module.compile`` on each layer): the forward
hooks are ``torch.compiler.disable``d (as PyTorch FSDP2 does with its own), so they run
eagerly around the compiled block and dynamo sees only gathered parameters. Dynamo guards a
parameter on its dtype, shape and strides, which freeing and refilling its storage in place
never change, so a block compiles once; the compiled backward saves the parameters
themselves (views of the flat buffer), never copies, so it too reads the refilled storage.
Both are checked by ``tests/test_zero.py::test_compiled_zero3_trains_like_one_eager_process``.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise import comm
from shardwise.comm.replicas import NO_REPLICAS, Replicas
from shardwise.parallel.data_parallel.ddp import broadcast_module_state, broadcast_tensors
from shardwise.parallel.experts.shard import is_expert
from shardwise.parallel.offload import Transfers
from shardwise.parallel.precision import DynamicLossScaler, fp32_step, host_master


class _Unit:
    def __init__(self, name: str, module: nn.Module | None, params: list[nn.Parameter],
                 group, param_dtype: torch.dtype, offload: bool = False,
                 offload_params: bool = False):
        self.name, self.module, self.params, self.group = name, module, params, group
        self.world, self.rank = world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.padded = -(-n // world) * world
        self.shard_size = self.padded // world
        p0 = params[0]
        fp32 = torch.zeros(self.padded, dtype=torch.float32, device=p0.device)
        for p, off in zip(params, self.offsets):
            fp32[off:off + p.numel()].copy_(p.detach().reshape(-1))
        lo = rank * self.shard_size
        mine = fp32[lo:lo + self.shard_size]
        # the fp32 master (offload: in host memory); what is gathered: the compute-dtype copy
        # of the shard on the device (the master itself in fp32 without offload), or with
        # offload_params in host memory (the master itself in fp32), copied to the device
        # for each gather
        self.shard = host_master(mine) if offload or offload_params else mine.clone()
        if offload_params:
            self.shard_lp = (self.shard if param_dtype == torch.float32
                             else host_master(mine, param_dtype))
        else:
            self.shard_lp = (self.shard if param_dtype == torch.float32 and not offload
                             else mine.to(param_dtype, copy=True))
        self.staged: torch.Tensor | None = None  # the device copy a gather in flight reads
        self.full = fp32.to(param_dtype)
        for p, off in zip(params, self.offsets):
            p.data = self.full[off:off + p.numel()].view_as(p)
        self.grad_shard = torch.zeros(self.shard_size, dtype=param_dtype, device=p0.device)
        self.gathered, self.handle = True, None
        self.fired: set[int] = set()

    @property
    def nbytes(self) -> int:
        return self.padded * self.full.element_size()


class ZeroStage3(nn.Module):
    """Wrap ``module`` for ZeRO-3 over ``group``; ``units`` are submodules gathered one by
    one (default: top-level children, with ``nn.ModuleList`` children expanded).

    Build the optimizer over ``param_groups(weight_decay)`` (fp32 pieces of this rank's
    shards). Per step: ``zero_grad()``, forward, ``scale_loss(loss).backward()``,
    ``step(optimizer, max_norm)``. ``full_parameters()`` gathers everything (every rank
    must enter it) for sampling or export. Per rank it holds 2P/N (compute-dtype shard) +
    2P/N (gradient shard) + 12P/N (fp32 master, Adam moments) bytes with bf16/fp16; in fp32
    the master is the gathered shard, so 16P/N. ``isolate``: ids of parameters that get a
    unit of their own (gathered with their layer's): a weight tied across pipeline stages,
    so that its shard covers the same elements of both copies and their gradients can be
    summed piece by piece. ``expert_group`` (expert parallelism): the expert parameters
    (``experts.is_expert``) of each unit (and of the root) become a unit of their own,
    broadcast, sharded, gathered and reduce-scattered over this group, the ranks holding the
    same experts (``ep_dp_cp``); their sums are divided by ``group``'s size as the dense
    ones' (each expert's gradient already holds every ep rank's tokens routed to it).
    ``replicas``: HSDP's other replicas (see module docstring). ``offload``: the fp32
    master shards in host memory (``training.offload``), a compute-dtype shard on the device;
    ``offload_params`` (``"optimizer+params"``): that shard in host memory too (the master
    itself in fp32), copied to the device for each gather (``offload.Transfers``: on CUDA
    on a side stream, overlapping the compute queued before the gather).
    Raises ``ValueError`` for a model without trainable parameters.
    """

    def __init__(self, module: nn.Module, group=None, units: list[tuple[str, nn.Module]] | None = None,
                 param_dtype: torch.dtype = torch.float32,
                 loss_scaler: DynamicLossScaler | None = None,
                 names: dict[int, str] | None = None, isolate: frozenset[int] = frozenset(),
                 expert_group=None, replicas: Replicas = NO_REPLICAS, offload: bool = False,
                 offload_params: bool = False):
        super().__init__()
        self.module, self.group, self.loss_scaler = module, group, loss_scaler
        self.replicas = replicas
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        experts = expert_group is not None

        def group_of(p) -> object:
            return expert_group if experts and is_expert(p) else group

        if experts:  # each expert parameter from the first rank holding the same experts
            broadcast_tensors([p for p in module.parameters() if not is_expert(p)]
                              + list(module.buffers()), group)
            broadcast_tensors([p for p in module.parameters() if is_expert(p)], expert_group)
        else:
            broadcast_module_state(module, group)
        if units is None:
            units = []
            for name, child in module.named_children():
                kids = list(child.named_children()) if isinstance(child, nn.ModuleList) else [("", child)]
                units += [(f"{name}.{k}" if k else name, c) for k, c in kids]
        names = names or {id(p): n for n, p in module.named_parameters()}
        owner: dict[int, list[int]] = {}
        for i, (_, m) in enumerate(units):
            for p in m.parameters():
                if p.requires_grad:
                    owner.setdefault(id(p), []).append(i)
        trainable = [p for p in module.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("parallel.zero: the model has no trainable parameters to shard")
        def split(ps: list[nn.Parameter]) -> list[tuple[list[nn.Parameter], object]]:
            """``ps`` as (parameters, group) pairs: the dense ones, then the experts'."""
            out = [([p for p in ps if group_of(p) is g], g)
                   for g in ((group, expert_group) if experts else (group,))]
            return [(x, g) for x, g in out if x]

        root = [p for p in trainable if len(owner.get(id(p), [])) != 1]  # shared or unowned
        self.units: list[_Unit] = []
        self.roots = [_Unit("root", None, ps, g, param_dtype, offload, offload_params)
                      for ps, g in split(root)]
        for i, (name, m) in enumerate(units):
            mine = [p for p in m.parameters() if p.requires_grad and owner[id(p)] == [i]]
            rest = [p for p in mine if id(p) not in isolate]
            for ps, g in [([p], group_of(p)) for p in mine if id(p) in isolate] + split(rest):
                u = _Unit(name, m, ps, g, param_dtype, offload, offload_params)
                self.units.append(u)
                m.register_forward_pre_hook(self._pre_forward(u))
                m.register_forward_hook(self._post_forward(u))
        self._all = self.units + self.roots
        self._copies = Transfers(trainable[0].device)  # offload_params: host to device
        self.offload_params = offload_params
        for u in self._all:
            for j, p in enumerate(u.params):
                p.register_post_accumulate_grad_hook(self._grad_ready(u, j))
        self.pieces, self.piece_names, self._decay, self._piece_src = [], [], [], []
        self.piece_params: list[nn.Parameter] = []  # the model parameter each piece is part of
        for u in self._all:
            lo = u.rank * u.shard_size
            for p, off in zip(u.params, u.offsets):
                a, z = max(off, lo), min(off + p.numel(), lo + u.shard_size)
                if a < z:
                    piece = nn.Parameter(u.shard[a - lo:z - lo])  # aliases the fp32 master
                    self.pieces.append(piece)
                    self.piece_params.append(p)
                    self._piece_src.append((u, a - lo, z - lo))
                    self.piece_names.append(f"{names[id(p)]}[{a - off}:{z - off}]")
                    self._decay.append(p.dim() >= 2)
        self._pending: list[tuple[_Unit, object, torch.Tensor]] = []
        self._queued = False
        self._summoned = False
        for u in self.units:
            self._free(u)

    # -- gather / free ----------------------------------------------------------------------
    def _launch_gather(self, u: _Unit) -> None:
        if u.gathered or u.handle is not None:
            return
        u.full.untyped_storage().resize_(u.nbytes)
        # offload_params: the host shard's device copy, kept until the gather is waited (the
        # shard itself when it is on the device: without offload, or on a CPU run)
        u.staged = self._copies.to_device(u.shard_lp)
        # check=False: shapes were agreed once, by the construction-time broadcast
        u.handle = comm.all_gather_into_tensor(u.full, u.staged, group=u.group, async_op=True,
                                               check=False, algorithm="auto")

    def _gather(self, u: _Unit) -> None:
        self._launch_gather(u)
        if u.handle is not None:
            u.handle.wait()
            u.handle, u.gathered, u.staged = None, True, None

    def _free(self, u: _Unit) -> None:
        if u.gathered and not self._summoned:
            u.full.untyped_storage().resize_(0)
            u.gathered = False

    def _neighbour(self, u: _Unit, step: int) -> _Unit | None:
        i = self.units.index(u) + step
        return self.units[i] if 0 <= i < len(self.units) else None

    # -- hooks ------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Gather the root units (shared parameters, kept whole for the step), then run the module;
        each other unit is gathered and freed around its own forward by hooks."""
        for r in self.roots:
            self._gather(r)
        return self.module(*args, **kwargs)

    def _pre_forward(self, u: _Unit):
        @torch.compiler.disable  # gathers (collectives, storage resize): eager around a compiled unit
        def hook(module, args):
            self._gather(u)
            nxt = self._neighbour(u, +1)
            if nxt is not None:
                self._launch_gather(nxt)  # prefetch: overlaps this unit's compute
        return hook

    def _post_forward(self, u: _Unit):
        @torch.compiler.disable  # frees the storage, hooks the output: eager, as the gather
        def hook(module, args, output):
            self._free(u)
            if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(self._pre_backward(u))
            return output
        return hook

    def _pre_backward(self, u: _Unit):
        def hook(grad):
            if not self._queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
                self._queued = True
            self._gather(u)
            prev = self._neighbour(u, -1)
            if prev is not None:
                self._launch_gather(prev)  # prefetch the unit whose backward comes next
            return grad
        return hook

    def _grad_ready(self, u: _Unit, j: int):
        def hook(p):
            u.fired.add(j)
            if len(u.fired) == len(u.params):
                self._reduce_scatter(u)
        return hook

    @torch.no_grad()
    def _reduce_scatter(self, u: _Unit) -> None:
        flat = torch.zeros(u.padded, dtype=u.full.dtype, device=u.full.device)
        for p, off in zip(u.params, u.offsets):
            if p.grad is not None:
                flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        out = torch.empty(u.shard_size, dtype=flat.dtype, device=flat.device)
        work = comm.reduce_scatter_tensor(out, flat, op="sum", group=u.group, async_op=True,
                                          check=False, algorithm="auto")
        self._pending.append((u, work, out))
        u.fired = set()
        if u not in self.roots:
            self._free(u)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        for u in self._all:  # units whose parameters got no gradient: reduce zeros
            if u.fired or not any(x[0] is u for x in self._pending):
                self._reduce_scatter(u)
        for u, work, out in self._pending:
            work.wait()  # expert units too: by dp x cp, their sums hold every ep rank's tokens
            # dense units by the shard group (finish averages over the replicas); expert units,
            # whose group spans the replicas, by the whole dp x cp at once
            div = self.world_size * (1 if u.group is self.group else self.replicas.size)
            u.grad_shard.add_(out, alpha=1.0 / div)
        self._pending, self._queued = [], False
        for r in self.roots:
            self._free(r)

    # -- optimizer side ---------------------------------------------------------------------
    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups over this rank's fp32 pieces: decay for matrices, none for vectors."""
        return [{"params": [m for m, d in zip(self.pieces, self._decay) if d], "weight_decay": weight_decay},
                {"params": [m for m, d in zip(self.pieces, self._decay) if not d], "weight_decay": 0.0}]

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradient shards (full gradients never outlive a unit's backward)."""
        for u in self._all:
            u.grad_shard.zero_()

    def no_sync(self):
        """Accepted for symmetry: ZeRO-3 reduce-scatters every micro-batch (see module doc)."""
        return nullcontext()

    def final_backward(self):
        """For the engine: every backward already reduce-scatters (see module doc)."""
        return nullcontext()

    def finish(self) -> None:
        """For the engine, once per step: the end-of-backward callback has already waited
        and averaged over the shard group; HSDP averages the dense shards over the replicas."""
        self.replicas.average_([u.grad_shard for u in self._all if u.group is self.group])

    @property
    def counted(self) -> list[bool]:
        """Every piece enters the global norm here (a group's ranks own disjoint shards);
        under HSDP a dense piece on replica 0 only (the replicas hold the same shards)."""
        return [u.group is not self.group or self.replicas.rank == 0
                for u, _, _ in self._piece_src]

    def piece_grads(self) -> list[torch.Tensor]:
        """fp32 gradient of each of ``pieces`` (transient copies)."""
        return [u.grad_shard[a:z].float() for u, a, z in self._piece_src]

    def after_step(self) -> None:
        """After the masters were stepped: refresh the shards that forward gathers."""
        self.refresh_params()

    # -- what this rank holds (for zero.memory) -------------------------------------------
    @property
    def numel(self) -> int:
        """P: elements of the trainable parameters (every unit), unpadded (for ``zero.memory``)."""
        return sum(u.numel for u in self._all)

    @property
    def padded_numel(self) -> int:
        """Elements of the units' flat buffers, each padded to a multiple of its group's size."""
        return sum(u.padded for u in self._all)

    @property
    def shard_numel(self) -> int:
        """Elements this rank owns over every unit, padding included (a unit's padded size over
        its group's size, summed)."""
        return sum(u.shard_size for u in self._all)

    def grad_shards(self) -> list[torch.Tensor]:
        """Each unit's gradient shard (compute dtype, ``shard_numel`` elements in all)."""
        return [u.grad_shard for u in self._all]

    def param_shards(self) -> list[torch.Tensor]:
        """Each unit's compute-dtype copy of its shard (none in fp32 without offload, or with
        offload_params: the master is what is gathered)."""
        return [u.shard_lp for u in self._all if u.shard_lp is not u.shard]

    def buckets_overlapped(self) -> None:
        """Our DDP's bucket overlap is not reported for ZeRO (``engine.sync``'s interface)."""
        return None

    def future_grad_bytes(self) -> int:
        """Gradient storage exists from the start (``engine.sync``'s interface)."""
        return 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (fp16), or ``loss`` itself."""
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    @torch.no_grad()
    def step(self, optimizer, max_norm: float = 0.0) -> dict:
        """Unscale, check overflow, clip and step the fp32 masters (see ``fp32_step``), then
        refresh the compute-dtype shards; units are gathered lazily by the next forward."""
        grads = self.piece_grads()
        out = fp32_step(optimizer, self.pieces, grads, self.group, max_norm, self.loss_scaler)
        if not out["skipped"]:
            self.refresh_params()
        return out

    @torch.no_grad()
    def refresh_params(self) -> None:
        """Copy the fp32 masters into the compute-dtype shards that forward gathers (host
        memory under offload_params: after the copies that read them)."""
        if self.offload_params:
            self._copies.wait()
        for u in self._all:
            if u.shard_lp is not u.shard:
                u.shard_lp.copy_(u.shard)
            if u.gathered and not self._summoned and u not in self.roots:
                self._free(u)
        for r in self.roots:
            if r.gathered:  # stale: re-gather on next forward
                r.full.untyped_storage().resize_(0)
                r.gathered = False

    @contextmanager
    def full_parameters(self):
        """Gather every unit (collectively) and keep them gathered inside the block."""
        for u in self._all:
            self._gather(u)
        self._summoned = True
        try:
            yield
        finally:
            self._summoned = False
            for u in self._all:
                self._free(u)

