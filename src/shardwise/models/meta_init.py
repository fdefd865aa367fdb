"""Build a model on the meta device, then give only the tensors a rank holds their values.

torchtitan builds its models under ``torch.device("meta")`` and initialises the shards after
parallelizing (``model.to_empty(device=...)`` then ``init_weights()``); Megatron-LM
initialises each partition directly. Both give values that depend on the layout. Here the
values must not: a rank's slices must equal, bit for bit, those of the single-process model
built after ``torch.manual_seed(seed)`` on the CPU. So we replay that construction's random
stream instead of inventing a new one:

- ``record_init(build)`` runs ``build()`` on the meta device under a ``TorchDispatchMode``
  that logs, in order, every initialising write to a tensor (``normal_``, ``uniform_``:
  they draw from the CPU generator; ``zero_``, ``fill_``: they do not). Meta tensors hold
  no memory, so this costs nothing that grows with the model (the first meta construction
  in a process imports torch's meta kernels and decompositions once: about 75 MiB of
  resident code, measured in ``benchmarks/meta_init.py``). Any other in-place write or
  random draw during construction raises ``NotImplementedError`` (it could not be replayed).
- ``replay_init(record, seed, names, sink)`` walks that log with a CPU generator seeded with
  ``seed`` (the stream ``torch.manual_seed(seed)`` gives the default generator). Every draw
  is made again, at the recorded shape and dtype, into a fresh scratch tensor, so the
  generator advances exactly as it did in the single-process constructor. The CPU
  generator (Mersenne Twister) has no way to skip ahead, so a draw nobody needs is made and
  dropped: memory stays at one full tensor. The last write to a parameter fixes its value
  (each logged op overwrites the whole tensor), so at that write, for each wanted name,
  ``sink(name, full)`` receives the full tensor (CPU) to cut its slice from; earlier writes
  to it (an ``nn.Linear``'s own Kaiming init before the GPT's normal init, a tied head's
  first embedding draw) only advance the generator. Each scratch tensor from 1 MiB lives in
  its own anonymous memory map, unmapped the moment it is dropped (``_scratch``): through
  malloc, freed scratch below glibc's dynamic mmap threshold stayed in the heap and rank
  peaks varied by up to 60 MiB from run to run (``benchmarks/meta_init.py``).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

_DRAWS = ("normal_", "uniform_")   # draw from the CPU generator
_FILLS = ("zero_", "fill_")        # no draw


@dataclass(frozen=True)
class _Op:
    target: int             # id() of the tensor written
    method: str             # one of _DRAWS + _FILLS
    shape: tuple[int, ...]
    dtype: torch.dtype
    args: tuple
    kwargs: dict


@dataclass
class InitRecord:
    """``model`` (every tensor on the meta device), the ordered writes that initialised it
    and ``ids``: parameter name (tied names included) -> id() of the tensor the writes name,
    taken at construction, so the model's modules may be sharded or materialised after.
    ``written`` keeps every written tensor alive (meta: free), so no id() is reused."""

    model: nn.Module
    ops: list[_Op]
    ids: dict[str, int]
    written: list[torch.Tensor]

    def last_writes(self) -> dict[int, int]:
        """id(tensor) -> index in ``ops`` of the write that fixed its value."""
        return {op.target: i for i, op in enumerate(self.ops)}


class _Recorder(TorchDispatchMode):
    """Logs initialising writes at the ATen level, below ``nn.init``'s own dispatch."""

    def __init__(self):
        super().__init__()
        self.ops: list[_Op] = []
        self.written: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _DRAWS + _FILLS:
            t = args[0]
            if kwargs.get("generator") is not None:
                raise NotImplementedError(f"{name} with its own generator cannot be replayed")
            self.written.append(t)
            self.ops.append(_Op(id(t), name, tuple(t.shape), t.dtype, tuple(args[1:]),
                                {k: v for k, v in kwargs.items() if k != "generator"}))
        elif torch.Tag.nondeterministic_seeded in func.tags or (
                name.endswith("_") and not name.startswith("_")):
            raise NotImplementedError(f"aten.{name} while building on the meta device: its "
                                      "effect on the values cannot be replayed")
        return func(*args, **kwargs)


def record_init(build: Callable[[], nn.Module]) -> InitRecord:
    """``build()`` on the meta device, with the log of its initialising writes. Raises
    ``NotImplementedError`` for a write it could not replay (see the module docstring)."""
    rec = _Recorder()
    with torch.device("meta"), rec:
        model = build()
    ids = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    return InitRecord(model, rec.ops, ids, rec.written)


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
    gives it on the CPU. Peak extra memory: one full tensor (and what ``sink`` keeps).
    Raises ``KeyError`` for a name the model does not have."""
    wanted: dict[int, list[str]] = {}
    for n in names:
        wanted.setdefault(record.ids[n], []).append(n)
    last = record.last_writes()
    final = {last[t]: ns for t, ns in wanted.items() if t in last}
    missing = [n for t, ns in wanted.items() if t not in last for n in ns]
    if missing:
        raise ValueError(f"no initialising write recorded for {missing[0]!r}")
    g = torch.Generator().manual_seed(seed)
    for i, op in enumerate(record.ops):
        keep = final.get(i)
        if op.method in _FILLS and keep is None:
            continue  # nothing drawn, nothing wanted
        full = _scratch(op.shape, op.dtype)  # one full tensor at a time, unmapped when dropped
        if op.method in _DRAWS:
            getattr(full, op.method)(*op.args, **op.kwargs, generator=g)
        else:
            getattr(full, op.method)(*op.args, **op.kwargs)
        for n in keep or ():
            sink(n, full)
        del full


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
