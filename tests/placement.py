"""Device and dtype placement of one rank of a big world, without the world.

``run_rank(sections, rank, world_size, device)`` builds the engine of one rank of a layout
(``sections``: config sections, as the parity suite's) under torch's fake process group
(``torch.testing._internal.distributed.fake_pg``: every collective and send/recv returns at
once and moves nothing, so one process stands for rank ``rank`` of ``world_size``) and runs
training steps, all under ``PlacementCheck``: a ``TorchDispatchMode`` that sees the outputs
of every aten op (construction, forward, backward, the gradient sync, ZeRO's shards, the
optimizer step, pipeline send/recv) and records each tensor created off the run's device or
with a floating dtype that is neither the compute dtype nor fp32 / fp64.

The device is ``cuda`` when a GPU is at hand (``pytest -m gpu``) and ``meta`` otherwise: on
the CPU a tensor made without ``device=`` lands on the CPU, and that is what a meta run
makes visible (on CUDA it would fail, or silently copy through the host). Values are
garbage (collectives move nothing); only placement is checked.

On meta nothing has values, so the check answers host reads itself (``MetaValues``):
``.item()`` / ``bool()`` / ``float()`` read 0 and a copy to the CPU (``.cpu()``,
``.tolist()``) reads zeros, except for integer tensors whose values decide shapes (the
mixture of experts' routing counts, which size its all-to-all and its grouped GEMM): those
get consistent values on a CPU shadow. The checks themselves never depend on values.

On meta ``comm``'s argument check runs too (its rounds read zeros: every rank agrees), so
its tensors are checked as well; on CUDA it is off (``fake_world``).

Collectives run inline (``comm``'s FIFO thread would run them outside the mode, which is
per thread); with the fake group nothing waits, so the order is unchanged.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from shardwise.base.config import Config

VOCAB = 65  # the characters of Shakespeare: not divisible by tp, so padding rows are built

# Copies are how a tensor deliberately changes device (``.cpu()`` for a host read,
# ``.to(device)`` of a batch); their outputs follow the caller's explicit request.
# ``lift_fresh`` is ``torch.tensor``'s: it sees the data before the move to ``device=``, so
# ``torch.tensor`` and the other constructors are checked where they return (``_Factories``).
_COPIES = {"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "to", "lift_fresh",
           "lift_fresh_copy", "_local_scalar_dense", "detach", "alias"}

# torch's fused attention kernels return their dropout RNG state (philox seed and offset)
# as 0-d CPU tensors by design: not the library's tensors.
_RNG_STATE_OUTPUTS = {"_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_cudnn_attention", "_efficient_attention_forward",
                      "_flash_attention_forward"}

# Code that makes CPU tensors on purpose, with the reason: (file suffix, function), or (a
# folder, None) for all of it. Matched against the innermost frame of a flagged op (torch's
# own code) and its innermost shardwise frame (the library's line that asked for it).
HOST_BY_DESIGN = {
    ("shardwise/models/meta_init.py", "replay_init"):
        "initialisation replays one CPU generator (parity with torch.manual_seed), then "
        "copies each slice to the device",
    ("shardwise/models/meta_init.py", "_scratch"): "replay_init's CPU draws",
    ("shardwise/engine/model.py", "build_local_model"):
        "partition by time: the profiling sample (the layers are profiled on the CPU)",
    ("shardwise/data/", None):
        "the corpus, its tokens and the sampler's batches live on the host; the trainer "
        "moves each batch to the device",
    ("shardwise/apps/lm/trainer.py", "evaluate"):
        "the validation windows are cut from the host tokens, then moved to the device",
    ("torch/optim/adamw.py", "_init_group"):
        "torch's AdamW keeps its step count on the CPU unless fused or capturable",
    ("torch/optim/adam.py", "_init_group"):
        "torch's Adam keeps its step count on the CPU unless fused or capturable",
}

# Calls whose whole extent runs on the CPU by design, wherever in the stack.
HOST_REGIONS = {
    ("shardwise/engine/model.py", "_one_at_a_time"):
        "partition by time materialises and profiles each layer on the CPU",
    ("shardwise/parallel/pipeline/partition.py", "profile_layers"): "the same profiling",
}

_SRC = os.sep + "shardwise" + os.sep


class PlacementError(AssertionError):
    """An op mixed devices and could not run (``PlacementCheck``)."""


@dataclass
class Violation:
    op: str
    what: str           # "device cpu (expected meta)", "dtype torch.float16", "mixes ..."
    where: str          # innermost shardwise frame: file:line in function
    stack: str = field(repr=False, default="")

    def __str__(self) -> str:
        return f"{self.op} -> {self.what} at {self.where}"


def _where(frames) -> str:
    for f in reversed(frames):
        if _SRC in f.filename and "/tests/" not in f.filename:
            return f"{f.filename.split(_SRC, 1)[1]}:{f.lineno} in {f.name}"
    own = [f for f in frames if os.sep + "torch" + os.sep not in f.filename
           and not f.filename.endswith("placement.py")]
    f = own[-1] if own else frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


class PlacementCheck(TorchDispatchMode):
    """Records (``violations``) every op output on a device other than ``device`` or with a
    floating dtype outside ``dtypes``, and every op mixing ``device`` tensors with CPU
    tensors of more than 0 dims (CUDA refuses those), except copies (``_COPIES``), work on
    host data (all tensor inputs already on the CPU) and ``HOST_BY_DESIGN`` code. On the meta
    device host reads answer zeros (module docstring)."""

    def __init__(self, device: torch.device, dtypes: set[torch.dtype]):
        super().__init__()
        self.device, self.dtypes = torch.device(device), set(dtypes)
        self.violations: list[Violation] = []
        self.ops = self.backward_ops = 0
        self.seen: set[str] = set()  # op names run (evidence of what the run covered)
        self.values = MetaValues()

    def _on_device(self, t: torch.Tensor) -> bool:
        """On the run's device, or on meta: a shape with no storage (the engine builds the
        model there first, by design)."""
        d = t.device
        return d.type == "meta" or d.type == self.device.type and (
            self.device.index is None or d.index in (None, self.device.index))

    def _flag(self, op: str, what: str) -> None:
        frames = traceback.extract_stack()[:-2]
        if any(f.filename.endswith(suffix) and f.name == name for f in frames
               for suffix, name in HOST_REGIONS):
            return
        ours = [f for f in frames if _SRC in f.filename and "/tests/" not in f.filename]
        for f in frames[-1:] + ours[-1:]:  # where torch made it, where our code asked
            for (suffix, name) in HOST_BY_DESIGN:
                if (f.filename.endswith(suffix) and f.name == name) or (
                        name is None and suffix in f.filename):
                    return
        self.violations.append(Violation(op, what, _where(frames),
                                         "".join(traceback.format_list(frames[-12:]))))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        name = func.__name__.split(".")[0]
        self.seen.add(f"{func.namespace}.{name}")
        if torch._C._current_graph_task_id() != -1:  # inside an autograd backward
            self.backward_ops += 1
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_dev = [t for t in ins if self._on_device(t)]
        host = [t for t in ins if t.device.type == "cpu"]
        mixed = (self.device.type != "cpu" and name not in _COPIES and on_dev
                 and any(t.dim() > 0 for t in host))
        if mixed:
            t = next(t for t in host if t.dim() > 0)
            self._flag(str(func), f"mixes {self.device.type} tensors with a CPU tensor "
                                  f"{tuple(t.shape)}")
        try:
            if self.device.type == "meta":
                out = self.values.run(func, name, args, kwargs)
            else:
                out = func(*args, **kwargs)
                if func.namespace == "c10d":
                    _fake_arrival(func, name, args, kwargs)
        except RuntimeError as exc:  # meta and CUDA refuse the mix: say where it was made
            if mixed:
                first = self.violations[0]
                raise PlacementError(str(self.violations[-1]) + (
                    f"; made at {first}" if first is not self.violations[-1] else "")) from exc
            raise
        if name in _COPIES:
            return out
        host_work = bool(ins) and not on_dev  # computing on host copies already made
        for o in tree_flatten(out)[0]:
            if not isinstance(o, torch.Tensor):
                continue
            if name in _RNG_STATE_OUTPUTS and o.dim() == 0 and not o.is_floating_point():
                continue
            if not self._on_device(o) and not host_work:
                self._flag(str(func), f"device {o.device} (expected {self.device}) "
                                      f"{o.dtype} {tuple(o.shape)}")
            elif o.is_floating_point() and o.dtype not in self.dtypes:
                self._flag(str(func), f"dtype {o.dtype} (run: {sorted(map(str, self.dtypes))})")
        return out


class _Factories(TorchFunctionMode):
    """``torch.tensor``, ``torch.as_tensor``, ``torch.zeros``... (torch's list of
    constructors that take ``device=``): the tensor they return must be on the run's device.
    (The dispatch level sees ``torch.tensor``'s data before its move to ``device=``.)"""

    def __init__(self, check: PlacementCheck):
        super().__init__()
        self.check = check
        self.constructors = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.constructors and isinstance(out, torch.Tensor) \
                and not self.check._on_device(out):
            self.check._flag(f"torch.{getattr(func, '__name__', func)}",
                             f"device {out.device} (expected {self.check.device}) "
                             f"{out.dtype} {tuple(out.shape)}")
        return out


class MetaValues:
    """Values for the few meta tensors whose values decide shapes (routing counts).

    Meta tensors have no data, so host reads (``.item()``, ``.cpu()``, ``.tolist()``)
    answer zeros, and a data-dependent op (``bincount``, ``repeat_interleave`` by counts)
    has no meta kernel. Where it matters, the mixture of experts' dropless routing, the
    values come from integer tensors only: a shadow on the CPU per meta storage (aliasing
    kept: a view's shadow is the same view of its storage's shadow), made by integer
    factories (``arange``), by ``bincount`` of a meta tensor without values (its n inputs
    spread evenly over the bins: any counts summing to n keep the shapes consistent) and by
    every op whose meta inputs all have shadows (computed on the CPU); an op that writes a
    shadowed storage from a meta tensor without one drops it. Collectives copy their input
    into their output (as if every peer held this rank's values)."""

    _FACTORIES = frozenset({"arange", "empty", "zeros", "ones", "full", "empty_like", "zeros_like",
                  "ones_like", "full_like", "new_empty", "new_zeros", "new_ones", "new_full",
                  "scalar_tensor", "empty_strided"})

    def __init__(self):
        self.shadow: dict[int, tuple] = {}  # storage key -> (storage, CPU uint8 buffer)

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def known(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.is_meta and self._key(t) in self.shadow

    def view(self, t: torch.Tensor) -> torch.Tensor:
        buf = self.shadow[self._key(t)][1]
        return buf.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    def adopt(self, meta: torch.Tensor, cpu: torch.Tensor) -> None:
        st = meta.untyped_storage()
        key = self._key(meta)
        if key not in self.shadow:
            n = max(st.nbytes(), meta.element_size())
            self.shadow[key] = (st, torch.zeros(n, dtype=torch.uint8))
        self.view(meta).copy_(cpu)

    def drop(self, t: torch.Tensor) -> None:
        if isinstance(t, torch.Tensor) and t.is_meta:
            self.shadow.pop(self._key(t), None)

    def _cpu(self, x):
        if isinstance(x, torch.Tensor) and x.is_meta:
            return self.view(x) if self.known(x) else None
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x

    def run(self, func, name: str, args, kwargs):
        metas = [t for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor) and t.is_meta]
        if name == "_local_scalar_dense" and metas:  # .item(), bool(), float()
            return self.view(metas[0]).item() if self.known(metas[0]) else \
                _zero_scalar(metas[0].dtype)
        if name == "_to_copy" and metas and torch.device(
                kwargs.get("device") or "meta").type == "cpu":  # .cpu(), .tolist()
            src = args[0]
            got = self.view(src) if self.known(src) else torch.zeros(src.shape, dtype=src.dtype)
            return got.to(kwargs.get("dtype") or src.dtype, copy=True)
        if name == "copy_" and not args[0].is_meta and metas:
            src = args[1]
            return args[0].copy_(self.view(src) if self.known(src) else
                                 torch.zeros(src.shape, dtype=src.dtype))
        if name == "bincount" and metas and not self.known(args[0]):
            n, bins = args[0].numel(), max(kwargs.get("minlength", args[2] if len(args) > 2
                                                      else 0), 1)
            cpu = torch.tensor([n // bins + (i < n % bins) for i in range(bins)])
            out = torch.empty(bins, dtype=torch.int64, device="meta")
            self.adopt(out, cpu)
            return out
        writes = _written(func, args, kwargs)
        factory = name in self._FACTORIES and not any(m.is_floating_point() for m in metas) \
            and _out_dtype(name, args, kwargs, metas) not in (None, "float")
        if (metas and all(self.known(m) for m in metas)) or (factory and _meta_kw(kwargs)):
            return self._both(func, name, args, kwargs, writes)
        out = func(*args, **kwargs)
        for w in writes:  # a shadowed storage written from values nobody has
            self.drop(w)
        return out

    def _both(self, func, name, args, kwargs, writes):
        cargs, ckwargs = tree_map(self._cpu, (args, kwargs))
        if func.namespace == "c10d":
            cpu = None
        else:
            cpu = func(*cargs, **ckwargs)
            if name in self._FACTORIES and isinstance(cpu, torch.Tensor) \
                    and name.startswith(("empty", "new_empty")):
                cpu.zero_()
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError):  # data-dependent shape: from the CPU
            out = tree_map(lambda c: torch.empty_strided(c.shape, c.stride(), dtype=c.dtype,
                                                         device="meta")
                           if isinstance(c, torch.Tensor) else c, cpu)
        if cpu is None:  # a collective: the output takes the input's values
            ts = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
            if len(ts) >= 2 and ts[0].numel() == ts[1].numel():
                self.adopt(ts[0], self.view(ts[1]).reshape(ts[0].shape))
            return out
        for o, c in zip(tree_flatten(out)[0], tree_flatten(cpu)[0]):
            if isinstance(o, torch.Tensor) and o.is_meta and isinstance(c, torch.Tensor) \
                    and not self.known(o):
                self.adopt(o, c)
        return out


_IN_PLACE = {"allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_", "send", "barrier"}


@torch.no_grad()
def _fake_arrival(func, name: str, args, kwargs) -> None:
    """What the fake group did not deliver, made harmless: the buffers a collective or a
    recv fills (its first argument; c10d's schemas mark no writes) would keep
    ``torch.empty``'s garbage (NaN logits for sampling, ids past the vocabulary, negative
    counts sizing the experts' all-to-all). Each takes the values of the input of the same
    size (the second argument: as if every peer held this rank's), else zeros. In-place
    collectives keep this rank's values."""
    if name in _IN_PLACE:
        return
    outs = [t for t in tree_flatten(args[0])[0] if isinstance(t, torch.Tensor)]
    ins = [t for t in tree_flatten(args[1:2])[0] if isinstance(t, torch.Tensor)]
    if len(ins) == len(outs) and all(i.numel() == o.numel() and i.dtype == o.dtype
                                     for i, o in zip(ins, outs)):
        for o, i in zip(outs, ins):
            o.copy_(i.reshape(o.shape))
    else:
        for o in outs:
            o.zero_()


def _written(func, args, kwargs) -> list:
    out = []
    schema = func._schema
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            out.extend(t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor))
    return out


def _meta_kw(kwargs) -> bool:
    d = kwargs.get("device")
    return d is not None and torch.device(d).type == "meta"


def _out_dtype(name, args, kwargs, metas):
    d = kwargs.get("dtype")
    if d is None and metas:
        d = metas[0].dtype
    if d is None:  # arange of integers is int64; other factories take the default dtype
        return "int" if name == "arange" and all(isinstance(a, int) for a in args) else "float"
    return "float" if d.is_floating_point or d.is_complex else "int"


def _zero_scalar(dtype: torch.dtype):
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point or dtype.is_complex else 0


# ------------------------------------------------------------------------- the fake world

class _InlineExecutor:
    """``comm``'s collectives run inline on the calling thread instead of on its FIFO
    thread: a dispatch mode is per thread, and under the fake group nothing ever waits, so
    the order is the same."""

    def __init__(self, real):
        self.real = real

    def submit(self, fn):
        from shardwise.comm.async_ import Handle

        fut: Future = Future()
        try:
            with torch.no_grad():
                fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 (delivered to wait(), as the thread does)
            fut.set_exception(exc)
        return Handle(fut)

    def run(self, fn):
        with torch.no_grad():
            return fn()

    def idle(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


@contextlib.contextmanager
def fake_world(rank: int, world_size: int, check_args: bool = False):
    """torch.distributed initialised as rank ``rank`` of ``world_size`` on the fake process
    group, ``comm``'s collectives inline, its argument check (``comm.check.agree``) on only
    with ``check_args``: it compares values that never arrive, which on meta read as zeros
    (every rank agrees) and on a real device as a disagreement. Restored on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardwise import comm
    from shardwise.comm import async_, primitives

    if dist.is_initialized():
        raise RuntimeError("fake_world: torch.distributed is already initialised")
    check = primitives.settings.check
    real = async_.executor
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    comm.configure(check=check_args)
    inline = _InlineExecutor(real)
    patched = [m for m in list(sys.modules.values())
               if m is not None and getattr(m, "__name__", "").startswith("shardwise.")
               and getattr(m, "executor", None) is real]
    for m in patched:
        m.executor = inline
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for m in patched:
            m.executor = real
        comm.configure(check=check)
        dist.destroy_process_group()


# ------------------------------------------------------------------------- one rank's run

def config(sections: dict) -> Config:
    """A tiny run in the layout of ``sections`` (merged over defaults)."""
    cfg = {
        "model": {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16},
        "parallel": {"dp": 1, "micro_batches": 1, "allreduce": "native"},
        "optimizer": {"lr": 3e-3, "warmup_steps": 1, "grad_clip": 1.0},
        "training": {"steps": 2, "global_batch_size": 8, "eval_every": 0, "sample_chars": 0,
                     "progress": False},
        "checkpoint": {"every": 0, "at_end": False},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return Config.from_dict(cfg)


@dataclass
class RankResult:
    coords: dict
    violations: list[Violation]
    structure: list[str]  # parameters / grads / masters / moments off device or dtype
    ops: int
    backward_ops: int
    seen: set[str]  # "namespace.op" of every op run
    losses: list


def run_rank(sections: dict, rank: int, world_size: int, device: torch.device,
             steps: int = 2, evaluate: bool = True, corpus: str | None = None) -> RankResult:
    """Rank ``rank`` of ``world_size`` of the layout ``sections``: engine built and
    ``steps`` training steps run under ``PlacementCheck`` on ``device`` (fake process
    group), then (``evaluate``) a validation loss and a two-token generation. With
    ``corpus`` (a text file) the language-model app's ``Trainer`` runs instead of the bare
    engine: its batches, its step, ``evaluate`` (the loss averaged over dp) and ``finish``'s
    sampling. Also checks, after the steps, where the state lives: every parameter and
    gradient on ``device`` in the compute dtype, every master piece and AdamW moment fp32."""
    from shardwise.base.topology import Topology, init_process_groups
    from shardwise.parallel.precision import DTYPES

    cfg = config({**sections, "data": {"path": corpus}} if corpus else sections)
    p, t = cfg.parallel, cfg.training
    device = torch.device(device)
    dtype = DTYPES[t.precision]
    mode = PlacementCheck(device, {dtype, torch.float32, torch.float64})
    with fake_world(rank, world_size, check_args=device.type == "meta"):
        topo = init_process_groups(Topology.build(p.dp, p.pp, p.tp, cp=p.cp, rank=rank,
                                                  world_size=world_size, ep=p.ep))
        local = t.global_batch_size // p.dp  # the bare engine's batches (the trainer samples)
        g = torch.Generator().manual_seed(rank)
        batches = [torch.randint(0, VOCAB, (local, cfg.model.block_size + 1), generator=g)
                   for _ in range(steps)]
        try:
            with mode:
                if corpus:
                    engine, losses = _run_trainer(cfg, topo, device, steps, evaluate)
                else:
                    engine, losses = _run_engine(cfg, topo, device, batches, evaluate)
        except Exception as exc:  # a stray tensor made something fail: name where it was made
            if mode.violations:
                raise PlacementError(f"{type(exc).__name__} after a tensor left the device: "
                                     f"{mode.violations[0]}") from exc
            raise
        structure = _state_placement(engine, device, dtype)
        return RankResult(topo.coords, mode.violations, structure, mode.ops,
                          mode.backward_ops, mode.seen, losses)


def _run_engine(cfg: Config, topo, device: torch.device, batches: list, evaluate: bool):
    from shardwise.engine import Engine, EngineSettings
    from shardwise.models import describe_section

    engine = Engine(describe_section(cfg.model, VOCAB), topo, EngineSettings.from_config(cfg),
                    device)
    losses = []
    for b in batches:
        b = b.to(device)
        losses.append(engine.train_step(b[:, :-1], b[:, 1:], sync=False)["loss"])
    engine.drain()
    if evaluate:  # forward-only passes: the validation loss, two sampled tokens
        b = batches[0].to(device)
        engine.loss(b[:, :-1], b[:, 1:])
        gen = (None if device.type == "meta"  # meta has no generator
               else torch.Generator(device=device).manual_seed(0))
        engine.generate(b[:1, :4], 2, generator=gen)
    return engine, losses


def _run_trainer(cfg: Config, topo, device: torch.device, steps: int, evaluate: bool):
    from shardwise.apps.lm.trainer import Trainer

    trainer = Trainer(cfg, topo, device)
    losses = [trainer.train_step(sync=i == steps - 1)["loss"] for i in range(steps)]
    trainer.engine.drain()
    if evaluate:
        trainer.evaluate()
        if device.type != "meta":  # sampling draws from a generator on the device
            with trainer.engine.full_parameters():
                trainer._sample()
    return trainer.engine, losses


def _state_placement(engine, device: torch.device, dtype: torch.dtype) -> list[str]:
    out = []

    def check(name, t, want):
        if t is None:
            return
        if t.device.type != device.type:
            out.append(f"{name}: on {t.device}, expected {device}")
        if want is not None and t.dtype != want:
            out.append(f"{name}: {t.dtype}, expected {want}")

    for n, q in engine.named_parameters():
        check(n, q, dtype)
        check(f"{n}.grad", q.grad, dtype)
    state = engine.optimizer.optimizer.state
    for i, m in enumerate(engine.sync.pieces):
        check(f"master piece {i}", m, torch.float32)
        for k in ("exp_avg", "exp_avg_sq"):
            check(f"master piece {i}.{k}", state.get(m, {}).get(k), torch.float32)
    return out
