"""Run one rank's instruction list: one method per instruction type.

Each run of consecutive transfers in the list is posted as one batch (receives into buffers
preallocated from the known activation shape, sends of the tensors computed) on
``shardwise.comm``'s FIFO thread (``comm.exchange(..., async_op=True)``) without waiting, so transfers
overlap with compute; a forward or backward waits only for the one tensor it needs. Gradients of the micro-batches accumulate in
``.grad``; ``OptimizerStep`` calls the ``on_step`` callback (for flush schedules once, at
the end; for PipeDream after every backward). With a ``grad_sync``
(``data_parallel.GradientSync``, dp > 1) the last backward of each chunk in a flush schedule
runs under ``grad_sync.final_backward()``, so each gradient bucket's all-reduce over the dp
group starts as soon as that bucket is final and overlaps the rest of the schedule.

Options:

- ``recompute``: the forward runs under ``no_grad`` and keeps only its input; the backward
  runs it again with autograd on, then backpropagates (activation checkpointing per chunk,
  Chen et al. 2016; the GPipe paper's "re-materialization").
- weight stashing (``schedule.weight_stashing``, PipeDream): the forward runs on a copy of
  the weights as they are then (version ``n``, the number of optimizer steps so far) and the
  backward differentiates that same copy, then adds the gradient to the live weights'
  ``.grad`` (Narayanan et al. 2019, section 3.3).

Split backward (``schedule.split``, the zero-bubble schedules; DualPipeV fuses some of its
backwards and splits the others, each instruction runs as itself): ``BackwardInput`` runs autograd
to the chunk's input only and hands the input gradient on at once (``split_backward``);
``BackwardWeight`` later accumulates the parameters' gradients in ``.grad`` through autograd,
so gradient hooks (dp buckets, ZeRO-2) see what the fused ``Backward`` gives them; under
``grad_sync`` it is the chunk's last W that runs under ``final_backward()``. Between the two
the graph's saved tensors stay metered and the gradients kept at the graph's frontier are
held in the meter. With ``recompute`` the B reruns the forward and the graph it builds is kept
until the W: the stage's activations are held from B to W as without recomputation.

Per micro-batch ``models.sequence`` shards (``run(..., shards=)``: context parallelism's
positions and ring, packed sequences' document ids) are kept on every rank from the
micro-batch's first forward to its last backward here, and each call of a chunk on that
micro-batch (the forward, and the backward's recomputation) runs inside its own
(``sequence.use``): a stage that never saw the tokens attends within the right documents.

``forward`` runs one micro-batch forward only through the same chunks (evaluation and
generation: ``schedules.forward_only``'s lists, outside the training step's state).

Under weight stashing, ``watch(pass, op, version, stash, chunk)`` (when set; None by
default) is called after each forward stashed and each backward used a version: how a test
checks that both passes saw the same weights, off the training path otherwise.

Each instruction's start and end (``time.perf_counter`` seconds, one clock for all local
processes) go to ``events``; with ``measure_memory`` the bytes autograd saves for backward
are metered (``meter.peak``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Sequence

import torch
import torch.nn as nn
from torch.func import functional_call

from shardwise import comm
from shardwise.models import sequence
from shardwise.parallel.pipeline.schedules import (
    COMM,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    Schedule,
    SendActivation,
    SendGrad,
    forward_only,
)
from shardwise.parallel.pipeline.split_backward import backward_input, backward_weight


class _Saved:
    __slots__ = ("meter", "key", "t")

    def __init__(self, meter: "ActivationMeter", key: int, t: torch.Tensor) -> None:
        self.meter, self.key, self.t = meter, key, t

    def __del__(self) -> None:
        self.meter.release(self.key)


class ActivationMeter:
    """Bytes of tensors autograd holds for backward (storages counted once; weights excluded),
    plus explicitly held boundary tensors. ``peak`` is the most at once, in bytes."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}
        self.held = self.current = self.peak = 0
        self.exclude: set[int] = set()

    def pack(self, t: torch.Tensor):
        """Saved-tensor pack hook: count ``t``'s storage once (bytes added, ``peak`` updated, on its
        first reference); storages in ``exclude`` (weights) and empty ones are returned as is."""
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.exclude or st.nbytes() == 0:
            return t
        entry = self.live.setdefault(key, [st.nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current + self.held)
        entry[1] += 1
        return _Saved(self, key, t)

    @staticmethod
    def unpack(obj):
        """Saved-tensor unpack hook: the tensor ``pack`` wrapped, or ``obj`` itself."""
        return obj.t if isinstance(obj, _Saved) else obj

    def release(self, key: int) -> None:
        """Drop one reference to the storage at ``key`` (a packed tensor freed); with the last, its
        bytes leave ``current``. Unknown keys are ignored."""
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` more held outside autograd (negative: released), e.g. a recomputed
        chunk's kept input; updates ``peak``."""
        self.held += nbytes
        self.peak = max(self.peak, self.current + self.held)

    def hooks(self):
        """A ``saved_tensors_hooks`` context: what autograd saves inside it is metered."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class Executor:
    """Runs ``schedule.ranks[pp_rank]`` on the chunks this rank holds.

    ``chunks``: global chunk id -> module. ``pp_ranks[i]``: global rank of pipeline rank
    ``i``. ``act_shape``: shape of one micro-batch's activation between chunks (e.g.
    ``(B/m, T, C)``), ``dtype`` and ``device`` its dtype and device (receive buffers).
    ``loss_scale()``: the factor the loss is multiplied by before backward (fp16 loss
    scaling; 1 otherwise). ``loss_fn(output, target)`` -> scalar; the
    executor divides it by ``m`` so gradients are those of the mean over micro-batches.
    """

    def __init__(self, schedule: Schedule, pp_rank: int, chunks: dict[int, nn.Module],
                 pp_ranks: Sequence[int], act_shape: Sequence[int], *,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 on_step: Callable[[], None], dtype: torch.dtype = torch.float32,
                 group=None, recompute: bool = False, measure_memory: bool = False,
                 grad_sync=None, device: torch.device | str = "cpu",
                 loss_scale: Callable[[], float] = lambda: 1.0) -> None:
        if sorted(chunks) != schedule.chunks_of(pp_rank):
            raise ValueError(f"rank {pp_rank} holds chunks {sorted(chunks)}, the schedule "
                             f"expects {schedule.chunks_of(pp_rank)}")
        self.schedule, self.pp_rank, self.chunks = schedule, pp_rank, chunks
        self.pp_ranks, self.group = list(pp_ranks), group
        self.act_shape, self.dtype, self.device = tuple(act_shape), dtype, torch.device(device)
        self.loss_scale = loss_scale  # fp16: backward runs on loss * scale
        self.loss_fn, self.on_step, self.recompute = loss_fn, on_step, recompute
        self.grad_sync = None if schedule.weight_stashing else grad_sync
        self.last_chunk = schedule.n_chunks - 1
        self.version = 0  # optimizer steps taken: the weight version
        self.events: list[tuple[str, int, int, float, float]] = []
        self.losses: list[torch.Tensor] = []
        self.sends: list = []  # this run's send handles
        self.watch: Callable | None = None  # weight stashing: see the module docstring
        self._eval = False  # inside ``forward``: the last chunk returns its output
        self.meter = ActivationMeter()
        self.measure_memory = measure_memory  # the meter's Python hooks cost time: opt-in
        self.reset()
        self._run = {Forward: self._forward, Backward: self._backward,
                     BackwardInput: self._backward_input, BackwardWeight: self._backward_weight,
                     SendActivation: self._send_act, RecvActivation: self._recv_act,
                     SendGrad: self._send_grad, RecvGrad: self._recv_grad,
                     OptimizerStep: self._step}

    # -- one training step -------------------------------------------------------------
    def reset(self) -> None:
        """Forget every micro-batch in flight (a new, empty pipeline)."""
        self.inputs: dict = {}    # mb -> tokens, where chunk 0 lives
        self.targets: dict = {}   # mb -> targets, where the last chunk lives
        self.held: dict = {}      # (mb, chunk) -> (input, output or loss, stash)
        self.ready: dict = {}     # ("act"|"grad", mb, chunk) -> (tensor, handle or None)
        self.grad_out: dict = {}  # (mb, chunk) -> gradient w.r.t. the chunk's input
        self.weights: dict = {}   # (mb, chunk) -> what its B kept for its W (split)
        self.shards: dict = {}    # mb -> its models.sequence shard, on every rank

    @property
    def in_flight(self) -> int:
        """(micro-batch, chunk) pairs whose forward ran and whose backward (split: W) has not."""
        return len(self.held) + len(self.weights)

    def run(self, inputs: Sequence[torch.Tensor] | None,
            targets: Sequence[torch.Tensor] | None, ops: Sequence | None = None,
            first_mb: int = 0, shards: Sequence | None = None) -> list[float]:
        """Run this rank's list once from an empty pipeline, or, with ``ops``, one segment of
        a stream (``pipeline.stream``) that continues from where the previous call stopped.

        ``inputs[i]`` / ``targets[i]`` are micro-batch ``first_mb + i``'s tokens and targets,
        needed where chunk 0 / the last chunk lives (``None`` elsewhere, or for a drain).
        ``shards[i]``: micro-batch ``first_mb + i``'s ``models.sequence.SequenceShard``, on
        every rank (None: the chunks run with no shard set, whole sequences).
        Returns the micro-batch losses (unscaled, detached 0-d tensors on the device: nothing
        here waits for the device to read them) computed here, in order."""
        if ops is None:
            self.reset()
            ops = self.schedule.ranks[self.pp_rank]
            self.backwards_left = {c: self.schedule.m for c in self.chunks}
            self.launching = self._launching(ops)
        if 0 in self.chunks:  # other ranks ignore what they were given
            self.inputs.update({first_mb + i: x for i, x in enumerate(inputs or ())})
        if self.last_chunk in self.chunks:
            self.targets.update({first_mb + i: y for i, y in enumerate(targets or ())})
        if shards is not None:
            self.shards.update({first_mb + i: sh for i, sh in enumerate(shards)})
        self.losses: list[torch.Tensor] = []
        self.sends: list = []
        self.events = []  # this run's only
        self._execute(ops)
        return self.losses

    @torch.no_grad()
    def forward(self, x: torch.Tensor, act_shape: Sequence[int], shard=None
                ) -> torch.Tensor | None:
        """One micro-batch ``x`` (where chunk 0 lives: token ids, (B, T); None elsewhere)
        forward only through every chunk in order (``schedules.forward_only``), no autograd,
        inside ``models.sequence.use(shard)`` when a shard is given. ``act_shape``: the
        activation between chunks ((B, T, C): receive buffers). Returns the last chunk's
        output on its rank, None elsewhere. The training step's micro-batches in flight
        (PipeDream) and its events are kept apart. Every pipeline rank must call it."""
        kept = (self.inputs, self.targets, self.held, self.ready, self.grad_out, self.shards,
                self.losses, self.sends, self.events, self.act_shape, self.weights)
        self.reset()
        self.inputs, self.act_shape = {0: x}, tuple(act_shape)
        if shard is not None:
            self.shards[0] = shard
        self.losses, self.sends, self.events, self.output, self._eval = [], [], [], None, True
        try:
            s = self.schedule
            self._execute(forward_only(s.p, s.v, s.placement).ranks[self.pp_rank])
            return self.output
        finally:
            (self.inputs, self.targets, self.held, self.ready, self.grad_out, self.shards,
             self.losses, self.sends, self.events, self.act_shape, self.weights) = kept
            self._eval, self.output = False, None

    def _execute(self, ops) -> None:
        """Each instruction of ``ops`` in turn (a run of transfers posted as one batch), then
        wait for this rank's sends."""
        self.meter.exclude = _storages(p for c in self.chunks.values() for p in c.parameters())
        i = 0
        while i < len(ops):
            self._t0 = time.perf_counter()  # a compute moves it past its wait for input
            if isinstance(ops[i], COMM):  # post a run of transfers as one batch
                j = i
                while j < len(ops) and isinstance(ops[j], COMM):
                    j += 1
                self._post(ops[i:j])
            else:
                j = i + 1
                self._run[type(ops[i])](ops[i])
            t1 = time.perf_counter()
            self.events += [(type(op).__name__, op.mb, getattr(op, "chunk", -1), self._t0, t1)
                            for op in ops[i:j]]
            i = j
        for h in self.sends:
            h.wait()

    # -- compute ------------------------------------------------------------------------
    def _take(self, key: tuple) -> torch.Tensor:
        tensor, handle = self.ready.pop(key)
        if handle is not None:
            handle.wait()
            self._t0 = time.perf_counter()
        return tensor

    def _hooks(self):
        return self.meter.hooks() if self.measure_memory else contextlib.nullcontext()

    def _call(self, chunk: int, mb: int, x: torch.Tensor, stash):
        module = self.chunks[chunk]
        with sequence.use(self.shards[mb]) if self.shards else contextlib.nullcontext():
            return module(x) if stash is None else functional_call(module, stash, (x,))

    def _forward(self, op: Forward) -> None:
        if op.chunk == 0:
            x = self.inputs.pop(op.mb)
        else:
            x = self._take(("act", op.mb, op.chunk))
            x = x if self._eval else x.detach().requires_grad_()
        stash = None
        if self._eval:  # forward only: no autograd, the last chunk's output is the result
            out = self._call(op.chunk, op.mb, x, None)
            if op.chunk == self.last_chunk:
                self.output = out
            self._hand_on(op, x, out, None)
            return
        if self.schedule.weight_stashing:
            stash = {n: p.detach().clone().requires_grad_()
                     for n, p in self.chunks[op.chunk].named_parameters()}
            self.meter.exclude |= _storages(stash.values())  # weights, not activations
            if self.watch is not None:
                self.watch("forward", op, self.version, stash, self.chunks[op.chunk])
        with self._hooks(), torch.set_grad_enabled(not self.recompute):
            out = self._call(op.chunk, op.mb, x, stash)
            if op.chunk == self.last_chunk:
                loss = self.loss_fn(out, self.targets[op.mb] if self.recompute
                                    else self.targets.pop(op.mb))
                self.losses.append(loss.detach())
                out = loss * (self.loss_scale() / self.schedule.m)
        if self.recompute and op.chunk > 0:
            self.meter.hold(x.numel() * x.element_size())
        self._hand_on(op, x, out, stash)

    def _hand_on(self, op: Forward, x, out, stash) -> None:
        """Keep the forward's input and output for its backward and its send; the next chunk,
        when it lives here, takes the output directly."""
        self.held[(op.mb, op.chunk)] = (x, out, stash)
        if op.chunk < self.last_chunk and self.schedule.rank_of(op.chunk + 1) == self.pp_rank:
            self.ready[("act", op.mb, op.chunk + 1)] = (out.detach(), None)  # next chunk is here

    def _backward(self, op: Backward) -> None:
        x, out, stash = self.held.pop((op.mb, op.chunk))
        grad = None if op.chunk == self.last_chunk else self._take(("grad", op.mb, op.chunk))
        with self._hooks(), self._final(op.chunk):
            out = self._rerun(op, x, out, stash)
            if op.chunk == self.last_chunk:
                out.backward()
            else:
                out.backward(grad)
        del out
        if stash is not None:
            self.meter.exclude -= _storages(stash.values())
            for (name, p), s in zip(self.chunks[op.chunk].named_parameters(), stash.values()):
                p.grad = s.grad if p.grad is None else p.grad.add_(s.grad)
            if self.watch is not None:
                self.watch("backward", op, self.version, stash, self.chunks[op.chunk])
        self._hand_back(op, x.grad if op.chunk > 0 else None)

    def _rerun(self, op, x, out, stash):
        """Under ``recompute``, the chunk's forward again with autograd on (its scaled loss
        on the last chunk), releasing the kept input from the meter; else ``out``."""
        if not self.recompute:
            return out
        if op.chunk > 0:
            self.meter.hold(-x.numel() * x.element_size())
        out = self._call(op.chunk, op.mb, x, stash)
        if op.chunk == self.last_chunk:
            out = self.loss_fn(out, self.targets.pop(op.mb)) * (
                self.loss_scale() / self.schedule.m)
        return out

    def _hand_back(self, op, grad) -> None:
        """The input gradient ``grad`` of ``op``'s chunk to the previous chunk: directly when
        it lives here, else for its send; the micro-batch's shard goes after its last call."""
        if op.chunk == min(self.chunks):  # the micro-batch's last call on this rank
            self.shards.pop(op.mb, None)
        if op.chunk > 0:
            if self.schedule.rank_of(op.chunk - 1) == self.pp_rank:
                self.ready[("grad", op.mb, op.chunk - 1)] = (grad, None)
            else:
                self.grad_out[(op.mb, op.chunk)] = grad

    def _backward_input(self, op: BackwardInput) -> None:
        """B: the input gradient only, handed on at once; the graph is kept for the W."""
        x, out, stash = self.held.pop((op.mb, op.chunk))
        grad = None if op.chunk == self.last_chunk else self._take(("grad", op.mb, op.chunk))
        params = [p for p in self.chunks[op.chunk].parameters() if p.requires_grad]
        with self._hooks():
            out = self._rerun(op, x, out, stash)
            dx, kept = backward_input(out, grad, x if op.chunk > 0 else None, params)
        del out
        self.meter.hold(kept.nbytes)
        self.weights[(op.mb, op.chunk)] = kept
        self._hand_back(op, dx)

    def _backward_weight(self, op: BackwardWeight) -> None:
        """W: the parameters' gradients into ``.grad`` (the chunk's last W launches its dp
        buckets under ``grad_sync``), freeing what the B kept."""
        kept = self.weights.pop((op.mb, op.chunk))
        with self._hooks(), self._final(op.chunk):
            backward_weight(kept)
        self.meter.hold(-kept.nbytes)

    def _final(self, chunk: int):
        """Under ``grad_sync``, the chunk's last backward of the step launches its buckets."""
        if self.grad_sync is None:
            return contextlib.nullcontext()
        self.backwards_left[chunk] -= 1
        return self.grad_sync.final_backward() if self.backwards_left[chunk] == 0 \
            and chunk in self.launching \
            else contextlib.nullcontext()

    def _launching(self, ops) -> set[int]:
        """Chunks whose last backward (or W) of the step may launch their buckets: all but
        those sharing a parameter with a chunk of this rank whose last one comes later (a
        tied embedding and head on one rank, zbv's V), whose first gradient of that
        parameter would count as final. ``grad_sync.finish`` takes what they leave."""
        last = {op.chunk: i for i, op in enumerate(ops) if isinstance(op, (Backward,
                                                                            BackwardWeight))}
        ids = {c: {id(p) for p in m.parameters()} for c, m in self.chunks.items()}
        return {c for c in self.chunks if not any(
            d != c and ids[c] & ids[d] and last.get(d, -1) > last.get(c, -1)
            for d in self.chunks)}

    def _step(self, op: OptimizerStep) -> None:
        self.on_step()
        self.version += 1

    # -- communication --------------------------------------------------------------------
    def _post(self, ops) -> None:
        sends, recvs, keys = [], [], []
        for op in ops:
            kind, tensor, key = self._run[type(op)](op)
            if kind == "send":
                sends.append((tensor, self.pp_ranks[op.peer]))
            else:
                recvs.append((tensor, self.pp_ranks[op.peer]))
                keys.append((key, tensor))
        handle = comm.exchange(sends, recvs, group=self.group, async_op=True)
        for key, buf in keys:
            self.ready[key] = (buf, handle)
        if sends:
            self.sends.append(handle)

    def _send_act(self, op: SendActivation):
        x, out, stash = self.held[(op.mb, op.chunk)]
        if self.recompute:  # the backward recomputes it; keep only what the send reads
            self.held[(op.mb, op.chunk)] = (x, None, stash)
        return "send", out.detach(), None

    def _send_grad(self, op: SendGrad):
        return "send", self.grad_out.pop((op.mb, op.chunk)), None

    def _recv_act(self, op: RecvActivation):
        return "recv", torch.empty(self.act_shape, dtype=self.dtype, device=self.device), \
            ("act", op.mb, op.chunk)

    def _recv_grad(self, op: RecvGrad):
        return "recv", torch.empty(self.act_shape, dtype=self.dtype, device=self.device), \
            ("grad", op.mb, op.chunk)


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}
