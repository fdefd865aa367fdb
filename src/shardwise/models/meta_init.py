"""Build a model on the meta device, then give only the tensors a rank holds their values.

torchtitan builds its models under ``torch.device("meta")`` and initialises the shards after
parallelizing (``model.to_empty(device=...)`` then ``init_weights()``); Megatron-LM
initialises each partition directly. Both give values that depend on the layout. Here the
values must not: a rank's slices must equal, bit for bit, those of the single-process model
built after ``torch.manual_seed(seed)`` on the CPU. So we replay that construction's random
stream instead of inventing a new one:

- ``record_init(build)`` runs ``build()`` on the meta device under a ``TorchDispatchMode``
  that logs, in order, every in-place write to a tensor: draws from the CPU generator
  (``normal_``, ``uniform_``, any op that takes a generator), fills, and the arithmetic a
  constructor does in place (``mul_``, ``clamp_``, ``erfinv_`` ...). The nn.init functions
  that return at once on the meta device (``trunc_normal_``, ``orthogonal_``, ``sparse_``,
  ``dirac_``, ``eye_``: torch 2.13 skips their sampling there) are logged whole. Writes are
  keyed by storage, so a write through ``.data`` or ``detach()`` counts for the parameter.
  Meta tensors hold no memory, so this costs nothing that grows with the model (the first
  meta construction in a process imports torch's meta kernels and decompositions once:
  about 75 MiB of resident code, measured in ``benchmarks/meta_init.py``). What could not
  be replayed raises ``NotImplementedError`` naming the op: a random tensor made out of
  place (``torch.randn``), a write into part of a tensor, an op reading another tensor,
  ``out=``, a generator of the model's own.
- ``replay_init(record, seed, names, sink)`` walks that log with a CPU generator seeded with
  ``seed`` (the stream ``torch.manual_seed(seed)`` gives the default generator). Every draw
  is made again, at the recorded shape and dtype, into a fresh scratch tensor, so the
  generator advances exactly as it did in the single-process constructor. The CPU
  generator (Mersenne Twister) has no way to skip ahead, so a draw nobody needs is made and
  dropped: memory stays at one full tensor (two while an op reads what the previous one
  left). At the last write to a parameter, for each wanted name, ``sink(name, full)``
  receives the full tensor (CPU) to cut its slice from; earlier writes that the next one
  overwrites whole (an ``nn.Linear``'s own Kaiming init before the GPT's normal init, a tied
  head's first embedding draw) only advance the generator.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

# nn.init functions that return at once on the meta device (torch 2.13: "sampling is a
# no-op"), so their draws would be lost: while recording, each call is logged whole and
# replayed by calling the function itself on the CPU scratch tensor
_META_SKIPPING_INITS = ("_no_grad_trunc_normal_", "orthogonal_", "sparse_", "dirac_", "eye_")
_OVERWRITES = ("normal_", "uniform_", "random_", "exponential_", "cauchy_", "log_normal_",
               "geometric_", "fill_", "zero_")


@dataclass(frozen=True)
class _Op:
    target: int             # the storage written (``_key``)
    func: Callable          # an in-place ATen op, or an nn.init function (``call``)
    shape: tuple[int, ...]
    dtype: torch.dtype
    args: tuple             # every argument after the tensor (no tensors among them)
    kwargs: dict
    draws: bool             # draws from the generator (replayed with ``generator=g``)
    call: bool = False      # an nn.init function called whole

    @property
    def overwrites(self) -> bool:
        """Whether the op sets every element without reading the old values (a draw, a
        fill, an nn.init function); ``mul_``, ``clamp_``, ``erfinv_`` ... read them."""
        return self.call or self.name.split(".")[0] in _OVERWRITES

    @property
    def name(self) -> str:
        return getattr(self.func, "__name__", str(self.func))

    def apply(self, t: torch.Tensor, g: torch.Generator) -> None:
        kwargs = dict(self.kwargs, generator=g) if self.draws else self.kwargs
        self.func(t, *self.args, **kwargs)


@dataclass
class InitRecord:
    """``model`` (every tensor on the meta device), the ordered writes that initialised it
    and ``ids``: parameter name (tied names included) -> the storage the writes name (a
    parameter and its aliases share it), taken at construction, so the model's modules may
    be sharded or materialised after. ``written`` keeps every written tensor alive (meta:
    free), so no storage identity is reused."""

    model: nn.Module
    ops: list[_Op]
    ids: dict[str, int]
    written: list[torch.Tensor]

    def last_writes(self) -> dict[int, int]:
        """storage -> index in ``ops`` of the write that fixed its value."""
        return {op.target: i for i, op in enumerate(self.ops)}


class _Recorder(TorchDispatchMode):
    """Logs every in-place write at the ATen level, below ``nn.init``'s own dispatch:
    draws (``normal_``, ``uniform_``, any op that takes a generator) and the deterministic
    ops that follow them on the same tensor (``erfinv_``, ``mul_``, ``clamp_`` ...)."""

    def __init__(self):
        super().__init__()
        self.ops: list[_Op] = []
        self.written: list[torch.Tensor] = []

    def log(self, t: torch.Tensor, func: Callable, args: tuple, kwargs: dict, draws: bool,
            call: bool = False) -> None:
        if kwargs.get("generator") is not None:
            raise NotImplementedError(f"{getattr(func, '__name__', func)} with its own "
                                      "generator cannot be replayed")
        if any(isinstance(a, torch.Tensor) for a in tuple(args) + tuple(kwargs.values())):
            raise NotImplementedError(f"{getattr(func, '__name__', func)} reads another "
                                      "tensor while building on the meta device: its value "
                                      "cannot be replayed")
        storage = t.untyped_storage()
        if t.storage_offset() or t.numel() * t.element_size() != storage.nbytes():
            raise NotImplementedError(f"{getattr(func, '__name__', func)} writes into a view "
                                      "while building on the meta device: initialise the "
                                      "whole tensor")
        self.written.append(t)
        self.ops.append(_Op(_key(t), func, tuple(t.shape), t.dtype, tuple(args),
                            {k: v for k, v in kwargs.items() if k != "generator"}, draws, call))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if isinstance(kwargs.get("out"), torch.Tensor):
            raise NotImplementedError(f"aten.{name}(out=...) while building on the meta "
                                      "device: its effect on the values cannot be replayed")
        if name.endswith("_") and not name.startswith("_") and args and \
                isinstance(args[0], torch.Tensor):
            self.log(args[0], func, args[1:], kwargs, seeded)
        elif seeded:
            raise NotImplementedError(f"aten.{name} while building on the meta device: a "
                                      "random tensor made out of place cannot be replayed "
                                      "(draw into the parameter with nn.init instead)")
        return func(*args, **kwargs)


def _key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage: the same for the parameter, its ``.data`` and its
    ``detach()`` (aliases a constructor may write through)."""
    return t.untyped_storage()._cdata


@contextlib.contextmanager
def _recording_inits(rec: _Recorder):
    """Route the nn.init functions that skip the meta device through ``rec``."""
    saved = {n: getattr(nn.init, n) for n in _META_SKIPPING_INITS}

    def logged(name: str, fn: Callable) -> Callable:
        draws = "generator" in fn.__code__.co_varnames

        def init(tensor, *args, **kwargs):
            rec.log(tensor, fn, args, kwargs, draws, call=True)
            return tensor
        init.__name__ = name
        return init

    for n, fn in saved.items():
        setattr(nn.init, n, logged(n, fn))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def record_init(build: Callable[[], nn.Module]) -> InitRecord:
    """``build()`` on the meta device, with the log of its initialising writes. Raises
    ``NotImplementedError`` for a write it could not replay (see the module docstring)."""
    rec = _Recorder()
    with torch.device("meta"), _recording_inits(rec), rec:
        model = build()
    ids = {n: _key(p) for n, p in model.named_parameters(remove_duplicate=False)}
    return InitRecord(model, rec.ops, ids, rec.written)


@torch.no_grad()
def replay_init(record: InitRecord, seed: int, names: Iterable[str],
                sink: Callable[[str, torch.Tensor], None]) -> None:
    """Replay ``record`` from ``seed``: ``sink(name, full)`` once for each of ``names``
    (parameter names of the model as built, tied names included), ``full`` the CPU tensor of
    that parameter's shape holding exactly the value ``torch.manual_seed(seed); build()``
    gives it on the CPU. Peak extra memory: one full tensor per parameter whose writes are
    under way (one, for writes made tensor by tensor), and what ``sink`` keeps.
    Raises ``KeyError`` for a name the model does not have."""
    wanted: dict[int, list[str]] = {}
    for n in names:
        wanted.setdefault(record.ids[n], []).append(n)
    last = record.last_writes()
    missing = [n for t, ns in wanted.items() if t not in last for n in ns]
    if missing:
        raise ValueError(f"no initialising write recorded for {missing[0]!r}")
    reads_next = _reads_next(record.ops)
    g = torch.Generator().manual_seed(seed)
    live: dict[int, torch.Tensor] = {}  # wanted tensors whose next write reads them
    for i, op in enumerate(record.ops):
        want = op.target in wanted
        if not want and not op.draws:
            continue  # nothing drawn, nothing wanted
        full = live.pop(op.target, None)
        if full is None:
            if want and not op.overwrites:
                raise NotImplementedError(f"{op.name} on {wanted[op.target][0]!r} reads the "
                                          "value its factory gave (torch.ones ...), which "
                                          "the meta device does not keep: initialise it "
                                          "with nn.init first")
            full = torch.empty(op.shape, dtype=op.dtype)  # scratch, one tensor at a time
        op.apply(full, g)
        if want and last[op.target] == i:
            for n in wanted[op.target]:
                sink(n, full)
        elif want and reads_next[i]:
            live[op.target] = full
        del full


def _reads_next(ops: list[_Op]) -> list[bool]:
    """For each op, whether the next op on the same tensor reads the values it left."""
    out, nxt = [False] * len(ops), {}
    for i in range(len(ops) - 1, -1, -1):
        j = nxt.get(ops[i].target)
        out[i] = j is not None and not ops[j].overwrites
        nxt[ops[i].target] = i
    return out


def materialise(modules: Iterable[nn.Module], device: torch.device) -> None:
    """Give every meta parameter and buffer of ``modules`` uninitialised storage on
    ``device``, in place. Unlike ``nn.Module.to_empty`` it keeps a parameter shared by two
    modules shared (tied weights) and keeps attributes set on parameters (``tp_dim``)."""
    memo: dict[int, torch.Tensor] = {}
    for root in modules:
        for m in root.modules():
            for key, p in list(m._parameters.items()):
                if p is None:
                    continue
                if id(p) not in memo:
                    new = nn.Parameter(torch.empty_like(p, device=device),
                                       requires_grad=p.requires_grad)
                    new.__dict__.update(p.__dict__)
                    memo[id(p)] = new
                m._parameters[key] = memo[id(p)]
            for key, b in list(m._buffers.items()):
                if b is not None:
                    if id(b) not in memo:
                        memo[id(b)] = torch.empty_like(b, device=device)
                    m._buffers[key] = memo[id(b)]
