"""Build a model on the meta device, then give only the tensors a rank holds their values.

torchtitan builds its models under ``torch.device("meta")`` and initialises the shards after
parallelizing (``model.to_empty(device=...)`` then ``init_weights()``); Megatron-LM
initialises each partition directly. Both give values that depend on the layout. Here the
values must not: a rank's slices must equal, bit for bit, those of the single-process model
built after ``torch.manual_seed(seed)`` on the CPU. So we replay that construction's random
stream: ``record_init(build)`` runs ``build()`` on the meta device and logs, in order, every
initialising write to a tensor; ``replay_init(record, seed, names, sink)`` makes every draw
again with a CPU generator seeded with ``seed`` and hands ``sink(name, full)`` each wanted
tensor at its last write. Writes that cannot be replayed bit for bit raise
``NotImplementedError``. How the log and the replay work, and what a model may do while
building: docs/models.md, "Building on the meta device".
"""

from __future__ import annotations

import math
import mmap
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

_DRAWS = ("normal_", "uniform_")   # draw from the CPU generator
_FILLS = ("zero_", "fill_")        # no draw
# nn.init functions that return at once on the meta device (torch skips their work there,
# so no write reaches the dispatch mode) or write through ``out=``: name -> (arguments, draws).
# They are logged when called (``sys.setprofile``, whatever name they are called by) and
# replayed by calling them again on the CPU tensor with the replay's generator.
_CALLED = {"trunc_normal_": (("mean", "std", "a", "b"), True), "dirac_": (("groups",), False),
           "eye_": ((), False)}
# the same kind, not replayable bit for bit: refused with the reason
_REFUSED = {"orthogonal_": "its QR decomposition is not guaranteed to round alike on every "
            "rank", "sparse_": "it draws its permutations from the global generator, whatever "
            "generator it is given"}


@dataclass(frozen=True)
class _Op:
    target: int             # the storage written (``_storage_key``)
    method: str             # one of _DRAWS + _FILLS, "init." + a name of _CALLED, or
    shape: tuple[int, ...]  # "aten." + an in-place op that reads the tensor (``func``)
    dtype: torch.dtype
    args: tuple
    kwargs: dict
    func: Callable | None = None

    @property
    def overwrites(self) -> bool:
        """Whether the op sets every element without reading the old values (a draw, a
        fill, an nn.init function); the in-place arithmetic after a draw (``mul_``,
        ``clamp_``, ``erfinv_`` ...) reads them."""
        return self.func is None


def _storage_key(t: torch.Tensor) -> int:
    """Which tensor a write reaches: its storage (``p``, ``p.data`` and ``p.detach()`` share
    one; each meta tensor has its own)."""
    return t.untyped_storage()._cdata


def _whole(t: torch.Tensor) -> bool:
    """``t`` covers its whole storage, in order (not a slice, a transpose or an expansion)."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


@dataclass
class InitRecord:
    """``model`` (every tensor on the meta device), the ordered writes that initialised it,
    ``ids``: parameter name (tied names included) -> the storage the writes name, and
    ``shapes``: parameter name -> shape, both taken at construction, so the model's modules
    may be sharded or materialised after. ``written`` keeps every written tensor alive (meta:
    free), so no storage key is reused."""

    model: nn.Module
    ops: list[_Op]
    ids: dict[str, int]
    written: list[torch.Tensor]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def last_writes(self) -> dict[int, int]:
        """storage key -> index in ``ops`` of the write that fixed its value."""
        return {op.target: i for i, op in enumerate(self.ops)}


class _Recorder(TorchDispatchMode):
    """Logs initialising writes at the ATen level, below ``nn.init``'s own dispatch, and the
    ``_CALLED`` nn.init functions at the Python level (a profile hook)."""

    def __init__(self):
        super().__init__()
        self.ops: list[_Op] = []
        self.written: list[torch.Tensor] = []
        self.error: str | None = None  # raised once ``build`` returns (see ``_profile``)
        self.inside = None  # the frame of a logged nn.init call: its own writes are in it
        self.codes = {getattr(nn.init, n).__code__: n for n in (*_CALLED, *_REFUSED)
                      if hasattr(nn.init, n)}

    def _log(self, t: torch.Tensor, method: str, args: tuple, kwargs: dict,
             func: Callable | None = None) -> None:
        if not _whole(t):
            raise NotImplementedError(
                f"{method} on part of a tensor (a slice or a view) while building on the meta "
                "device cannot be replayed: initialise whole parameters")
        self.written.append(t)
        self.ops.append(_Op(_storage_key(t), method, tuple(t.shape), t.dtype, args, kwargs,
                            func))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside is not None:  # within a logged nn.init call: replayed as one
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _DRAWS + _FILLS:
            if kwargs.get("generator") is not None:
                raise NotImplementedError(f"{name} with its own generator cannot be replayed")
            self._log(args[0], name, tuple(args[1:]),
                      {k: v for k, v in kwargs.items() if k != "generator"})
        elif (name.endswith("_") and not name.startswith("_") and args
              and isinstance(args[0], torch.Tensor) and "out" not in kwargs
              and torch.Tag.nondeterministic_seeded not in func.tags
              and not any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values()))):
            # in-place arithmetic on one tensor (``w.uniform_(); w.mul_(2).clamp_(-1, 1)``):
            # deterministic given the values before it, so replayed on the same tensor
            self._log(args[0], f"aten.{name}", tuple(args[1:]), dict(kwargs), func)
        elif torch.Tag.nondeterministic_seeded in func.tags or func._schema.is_mutable:
            raise NotImplementedError(f"aten.{name} while building on the meta device: its "
                                      "effect on the values cannot be replayed (nn.init's "
                                      "normal_, uniform_, zeros_, ones_, constant_, "
                                      "trunc_normal_ can)")
        return func(*args, **kwargs)

    def _profile(self, frame, event, arg) -> None:
        """``sys.setprofile`` hook: log a call of a ``_CALLED`` nn.init function on a meta
        tensor (torch skips their work there). Never raises (a profile hook's exception
        would unset it): the first problem is kept in ``error``."""
        if event == "return" and frame is self.inside:
            self.inside = None
        if event != "call" or self.inside is not None or frame.f_code not in self.codes:
            return
        name = self.codes[frame.f_code]
        local = frame.f_locals
        t = local.get("tensor")
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return  # a real tensor: its writes reach the dispatch mode
        self.inside = frame
        if self.error is not None:
            return
        if name in _REFUSED:
            self.error = (f"nn.init.{name} while building on the meta device cannot be "
                          f"replayed: {_REFUSED[name]}")
        elif local.get("generator") is not None:
            self.error = f"nn.init.{name} with its own generator cannot be replayed"
        else:
            try:
                self._log(t, f"init.{name}", (), {k: local[k] for k in _CALLED[name][0]})
            except NotImplementedError as e:
                self.error = str(e)


def record_init(build: Callable[[], nn.Module]) -> InitRecord:
    """``build()`` on the meta device, with the log of its initialising writes. Raises
    ``NotImplementedError`` for a write it could not replay (see the module docstring)."""
    rec = _Recorder()
    previous = sys.getprofile()
    sys.setprofile(rec._profile)
    try:
        with torch.device("meta"), rec:
            model = build()
    finally:
        sys.setprofile(previous)
    if rec.error is not None:
        raise NotImplementedError(rec.error)
    named = model.named_parameters(remove_duplicate=False)
    ids, shapes = {}, {}
    for n, p in named:
        ids[n], shapes[n] = _storage_key(p), tuple(p.shape)
    return InitRecord(model, rec.ops, ids, rec.written, shapes)


_MAP_BYTES = 1 << 20  # scratch from this size gets its own memory map


def _scratch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised, contiguous CPU tensor for one replayed write. From ``_MAP_BYTES`` it
    lies in an anonymous memory map that the kernel takes back as soon as the tensor (the
    map's last reference) is freed. Through malloc it would not: glibc raises its mmap
    threshold to the size of the first large block freed (up to 32 MiB) and returns freed
    heap only once 64 MiB lie free at its top, so the replay's dropped draws stayed resident
    and each rank's peak grew by up to 60 MiB, differently from run to run."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _MAP_BYTES:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


@torch.no_grad()
def replay_init(record: InitRecord, seed: int, names: Iterable[str],
                sink: Callable[[str, torch.Tensor], None]) -> None:
    """Replay ``record`` from ``seed``: ``sink(name, full)`` once for each of ``names``
    (parameter names of the model as built, tied names included), ``full`` the CPU tensor of
    that parameter's shape holding exactly the value ``torch.manual_seed(seed); build()``
    gives it on the CPU. Peak extra memory: one full tensor (two while in-place arithmetic
    follows a draw on a tensor this rank wants), and what ``sink`` keeps.
    Raises ``KeyError`` for a name the model does not have."""
    wanted: dict[int, list[str]] = {}
    for n in names:
        wanted.setdefault(record.ids[n], []).append(n)
    last = record.last_writes()
    final = {last[t]: ns for t, ns in wanted.items() if t in last}
    missing = [n for t, ns in wanted.items() if t not in last for n in ns]
    if missing:
        raise ValueError(f"no initialising write recorded for {missing[0]!r}: give it its "
                         "value with an nn.init in-place write (a tensor made by torch.zeros, "
                         "torch.ones or torch.tensor has no value on the meta device)")
    reads_next = _reads_next(record.ops)
    g = torch.Generator().manual_seed(seed)
    live: dict[int, torch.Tensor] = {}  # wanted tensors whose next write reads them
    for i, op in enumerate(record.ops):
        keep = final.get(i)
        want = op.target in wanted
        called = _CALLED.get(op.method[len("init."):]) if op.method.startswith("init.") else None
        draws = op.method in _DRAWS or (called is not None and called[1])
        if not want and not draws:
            continue  # nothing drawn, nothing wanted
        full = live.pop(op.target, None)
        if full is None:
            if not op.overwrites:
                raise NotImplementedError(f"{op.method} on {wanted[op.target][0]!r} reads the "
                                          "value its factory gave (torch.ones ...), which the "
                                          "meta device does not keep: give it a value with "
                                          "nn.init first")
            full = _scratch(op.shape, op.dtype)  # one tensor at a time, unmapped when dropped
        if called is not None:
            draw = {"generator": g} if called[1] else {}
            getattr(nn.init, op.method[len("init."):])(full, **op.kwargs, **draw)
        elif op.func is not None:
            op.func(full, *op.args, **op.kwargs)
        elif op.method in _DRAWS:
            getattr(full, op.method)(*op.args, **op.kwargs, generator=g)
        else:
            getattr(full, op.method)(*op.args, **op.kwargs)
        for n in keep or ():
            sink(n, full.view(record.shapes[n]) if record.shapes else full)
        if want and keep is None and reads_next[i]:
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
