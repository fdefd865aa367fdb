"""ZeRO stages 1 and 2: optimizer states (and gradients) partitioned over the dp group.

Following Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (SC 2020), with the shard layout of ``zero.sharding``:

- every rank keeps the full parameters in the compute dtype (as views into one flat
  buffer per bucket, so the all-gather writes straight into them) but fp32 master weights
  and Adam moments only for its own shard: 2P + 2P + 12P/N bytes with bf16/fp16 for
  stage 1 (the gradient shard is reduce-scattered in place into the rank's own slice of
  the full gradient buffer), 2P + 2P/N + 12P/N for stage 2;
- backward: a post-accumulate-grad hook per parameter fills its bucket; a full bucket is
  reduce-scattered at once (asynchronously, overlapping the rest of backward), so each
  rank receives the summed gradient of its shard; the end-of-backward callback waits and
  divides by N;
- stage 1 keeps the full gradient buffers between steps (``param.grad`` stays a view, as in
  our DDP); stage 2 frees them after backward, so only the gradient shard (P/N) remains;
- HSDP (``replicas``, a ``comm.replicas.Replicas``): ``group`` is one replica's shard
  group; once reduce-scattered and divided, the gradient shards are averaged across the
  replicas (each holds the same shard layout), one call per step (FSDP2's hybrid sharding);
- ``step``: the gradient shard is upcast to fp32 (transiently), unscaled and checked for
  overflow (fp16), clipped by the global norm (squared shard norms summed over the group,
  so it is the norm one process would compute), the caller's optimizer updates the fp32
  master shard, and every rank's updated shard is all-gathered into the full parameters.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise import comm
from shardwise.comm.replicas import NO_REPLICAS, Replicas
from shardwise.parallel.data_parallel.buckets import MiB
from shardwise.parallel.data_parallel.ddp import broadcast_module_state, broadcast_tensors
from shardwise.parallel.precision import DynamicLossScaler, fp32_step, host_master
from shardwise.parallel.zero.sharding import ShardLayout


class ZeroDataParallel(nn.Module):
    """Wrap ``module`` for ZeRO stage 1 or 2 over ``group``.

    Args:
        module: the full model, identical shapes on every rank (weights are broadcast from
            the group's first rank).
        group: the dp process group (``None``: the world).
        stage: 1 (optimizer states sharded) or 2 (gradients too).
        bucket_mb: bucket capacity in MiB (also the unit of reduce-scatter/all-gather).
        param_dtype: compute dtype of parameters and gradients (fp32, bf16 or fp16).
        loss_scaler: a ``DynamicLossScaler`` (needed for fp16), or None.
        params: the parameters to shard (default: every trainable one of ``module``); only
            they are broadcast from the group's first rank (expert parallelism wraps its
            expert parameters in a second instance over the ``ep_dp`` group).
        divisor: the gradient shards are the sums divided by this (default: the group
            size; expert parameters: the whole dp size).
        replicas: HSDP's other replicas (``group`` is then one replica's shard group): the
            divided gradient shards are averaged across them (default: none).
        offload: the fp32 master shard in host memory (``training.offload``; pinned on CUDA).

    Build the optimizer over ``param_groups(weight_decay)``: those are fp32 pieces of this
    rank's shard, one per parameter that intersects it. Per step: ``zero_grad()``,
    forward, ``scale_loss(loss).backward()`` (``no_sync()`` for accumulation), then
    ``step(optimizer, max_norm)``.

    Raises ``ValueError`` for a stage other than 1 or 2 or a model without trainable
    parameters.
    """

    def __init__(self, module: nn.Module, group=None, stage: int = 1, bucket_mb: float = 25.0,
                 param_dtype: torch.dtype = torch.float32,
                 loss_scaler: DynamicLossScaler | None = None,
                 names: dict[int, str] | None = None, isolate: frozenset[int] = frozenset(),
                 explicit: bool = False, params: list[nn.Parameter] | None = None,
                 divisor: int | None = None, replicas: Replicas = NO_REPLICAS,
                 offload: bool = False):
        super().__init__()
        self.replicas = replicas
        # explicit: the engine says which backward is final (``final_backward``) and calls
        # ``finish``; otherwise every backward is final and ends in an autograd callback
        self.explicit = explicit
        if stage not in (1, 2):
            # the API's own argument (parallel.zero's choices are the config's)
            raise ValueError(f"stage={stage}: ZeroDataParallel implements stages 1 and 2 "
                             "(ZeroStage3: stage 3)")
        whole = params is None
        params = [p for p in (module.parameters() if whole else params) if p.requires_grad]
        if not params:
            raise ValueError("parallel.zero: the model has no trainable parameters to shard")
        self.module, self.group, self.stage = module, group, stage
        self.loss_scaler = loss_scaler
        self.world_size = dist.get_world_size(group)
        self.divisor = self.world_size if divisor is None else divisor
        if whole:
            broadcast_module_state(module, group)
        else:
            broadcast_tensors(params, group)
        fp32 = {id(p): p.detach().float().clone() for p in params}  # source of the masters
        for p in params:
            p.data = p.data.to(param_dtype)
        self.layout = ShardLayout(params, self.world_size, dist.get_rank(group),
                                  max(1, int(bucket_mb * MiB)), isolate)
        names = names or {id(p): n for n, p in module.named_parameters()}
        self._flat_params: list[torch.Tensor] = []
        for b in self.layout.buckets:  # parameters become views of one flat buffer per bucket
            flat = torch.zeros_like(b.buffer)
            for i, p in enumerate(b.params):
                view = flat[b.offsets[i]:b.offsets[i] + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view
            self._flat_params.append(flat)
        dev = params[0].device
        self._master = [host_master(torch.zeros(n, device=dev)) if offload
                        else torch.zeros(n, dtype=torch.float32, device=dev)
                        for n in self.layout.shard_sizes]
        if stage == 1:  # reduce-scattered in place: the shard is this rank's slice of the bucket
            r = self.layout.rank
            self._grad_shard = [b.buffer[r * n:(r + 1) * n]
                                for b, n in zip(self.layout.buckets, self.layout.shard_sizes)]
        else:
            self._grad_shard = [torch.zeros(n, dtype=param_dtype, device=dev)
                                for n in self.layout.shard_sizes]
        self.pieces: list[nn.Parameter] = []
        self.piece_names: list[str] = []
        self.piece_params: list[nn.Parameter] = []  # the model parameter each piece is part of
        self._decay: list[bool] = []
        for pc in self.layout.pieces:
            p = self.layout.buckets[pc.bucket].params[pc.param_index]
            sl = slice(pc.shard_start, pc.shard_start + pc.numel)
            master = nn.Parameter(self._master[pc.bucket][sl])  # aliases the master shard
            with torch.no_grad():
                master.copy_(fp32[id(p)].reshape(-1)[pc.param_start:pc.param_end])
            self.pieces.append(master)
            self.piece_params.append(p)
            self.piece_names.append(f"{names[id(p)]}[{pc.param_start}:{pc.param_end}]")
            self._decay.append(p.dim() >= 2)
        del fp32
        if stage == 2:
            for b in self.layout.buckets:
                b.buffer = b.buffer.new_empty(0)  # full gradients exist only during backward
        self.require_sync = not explicit
        self._next = 0
        self._queued = False
        for b in self.layout.buckets:
            for i, p in enumerate(b.params):
                p.register_post_accumulate_grad_hook(self._hook(b, i))

    # -- optimizer side ---------------------------------------------------------------------
    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups over this rank's pieces: decay for matrices, none for vectors."""
        return [{"params": [m for m, d in zip(self.pieces, self._decay) if d],
                 "weight_decay": weight_decay},
                {"params": [m for m, d in zip(self.pieces, self._decay) if not d],
                 "weight_decay": 0.0}]

    # -- what this rank holds (for zero.memory) -------------------------------------------
    @property
    def numel(self) -> int:
        """P: elements of the sharded parameters, unpadded (for ``zero.memory``)."""
        return self.layout.numel

    @property
    def padded_numel(self) -> int:
        """Elements of the buckets, each padded to a multiple of the group size N (by < N)."""
        return sum(self.layout.padded)

    @property
    def shard_numel(self) -> int:
        """Elements this rank owns, padding included: ``padded_numel / N``."""
        return self.layout.shard_numel

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's gradient shard of each bucket (compute dtype; stage 1: slices of the full
        buffers)."""
        return list(self._grad_shard)

    def param_shards(self) -> list[torch.Tensor]:
        """Empty: stages 1 and 2 hold the full parameters (counted as the model's)."""
        return []  # stages 1 and 2 hold the full parameters (counted as model parameters)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (fp16), or ``loss`` itself."""
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    @torch.no_grad()
    def step(self, optimizer, max_norm: float = 0.0) -> dict:
        """Unscale, check overflow, clip, step the fp32 masters, all-gather the parameters.

        Returns ``{"grad_norm": 0-d tensor, "skipped": bool}`` (skipped: fp16 overflow).
        """
        grads = self.piece_grads()
        out = fp32_step(optimizer, self.pieces, grads, self.group, max_norm, self.loss_scaler)
        if not out["skipped"]:
            self.all_gather_params()
        return out

    def refresh_params(self) -> None:
        """After loading master weights: rebuild the full parameters from them."""
        self.all_gather_params()

    @torch.no_grad()
    def all_gather_params(self) -> None:
        """After the optimizer step: every rank's updated shard into the full parameters."""
        handles = [comm.all_gather_into_tensor(flat, master.to(flat.device, flat.dtype),
                                               group=self.group,
                                               async_op=True, check=False, algorithm="auto")
                   for flat, master in zip(self._flat_params, self._master)]
        for h in handles:
            h.wait()

    def full_parameters(self):
        """Stages 1 and 2 always hold the full parameters: nothing to gather."""
        return nullcontext()

    def buckets_overlapped(self) -> None:
        """Our DDP's bucket overlap is not reported for ZeRO (``engine.sync``'s interface)."""
        return None

    def future_grad_bytes(self) -> int:
        """Gradient storage exists from the start (``engine.sync``'s interface)."""
        return 0

    # -- forward / backward -----------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """The wrapped module's forward; in backward, hooks reduce-scatter each bucket once full
        (not under ``no_sync``)."""
        return self.module(*args, **kwargs)

    @contextmanager
    def _syncing(self, flag: bool):
        prev, self.require_sync = self.require_sync, flag
        try:
            yield
        finally:
            self.require_sync = prev

    def no_sync(self):
        """Accumulate gradients locally (full size) and reduce-scatter on the next backward."""
        return self._syncing(False)

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = False) -> None:
        """Stage 1: zero the gradient buckets in place, ``param.grad`` stays their view.
        Stage 2 (or ``set_to_none``): drop the full gradients; backward allocates them."""
        for b in self.layout.buckets:
            if self.stage == 1 and not set_to_none:
                b.buffer.zero_()
                for i, p in enumerate(b.params):
                    p.grad = b.view_of(i)
            else:
                for p in b.params:
                    p.grad = None

    def _hook(self, b, i):
        def on_grad_ready(p: torch.nn.Parameter) -> None:
            if not self.require_sync:
                return
            if not self._queued and not self.explicit:
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
                self._queued = True
            if b.buffer.numel() == 0:  # stage 2: this bucket's buffer was freed last step
                b.buffer = torch.zeros(self.layout.padded[b.index], dtype=p.dtype, device=p.device)
            if b.add_grad(i, p):
                self._launch_ready()
        return on_grad_ready

    def _launch_ready(self) -> None:
        buckets = self.layout.buckets
        while self._next < len(buckets) and buckets[self._next].ready:
            b = buckets[self._next]
            b.work = comm.reduce_scatter_tensor(self._grad_shard[b.index], b.buffer, op="sum",
                                                group=self.group, async_op=True, check=False,
                                                algorithm="auto")
            self._next += 1

    def final_backward(self):
        """Explicit mode: backwards inside the block make gradients final (buckets launch)."""
        return self._syncing(True)

    def finish(self) -> None:
        """Explicit mode: launch what is left, wait, divide: the gradient shards are the mean."""
        self._finish_backward()

    @property
    def counted(self) -> list[bool]:
        """The shard's pieces enter the global norm here (a shard group's ranks own disjoint
        shards), on replica 0 only (HSDP: the replicas hold the same shards)."""
        return [self.replicas.rank == 0] * len(self.pieces)

    def piece_grads(self) -> list[torch.Tensor]:
        """fp32 gradient of each of ``pieces`` (transient copies)."""
        return [self._grad_shard[pc.bucket][pc.shard_start:pc.shard_start + pc.numel].float()
                for pc in self.layout.pieces]

    def after_step(self) -> None:
        """After the masters were stepped: every rank's shard into the full parameters."""
        self.all_gather_params()

    @torch.no_grad()
    def _finish_backward(self) -> None:
        for b in self.layout.buckets[self._next:]:
            if b.buffer.numel() == 0:
                b.buffer = torch.zeros(self.layout.padded[b.index], dtype=b.params[0].dtype,
                                       device=b.params[0].device)
            for i, p in enumerate(b.params):  # gradients accumulated outside final_backward
                if i not in b.fired and p.grad is not None:
                    b.add_grad(i, p)
            b.close_unfired()
        self._launch_ready()
        for b in self.layout.buckets:
            b.work.wait()
        for g in self._grad_shard:
            g.div_(self.divisor)
        self.replicas.average_(self._grad_shard)  # HSDP: the mean over every replica
        for b in self.layout.buckets:
            if self.stage == 2:
                for p in b.params:
                    p.grad = None
                b.buffer = b.buffer.new_empty(0)
            b.reset()
        self._next, self._queued = 0, False
