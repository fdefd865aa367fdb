"""A dispatch mode that fails on any tensor made off the run's device or in a foreign dtype.

``PlacementCheck(device, dtypes)`` sees the outputs of every aten op run under it (the
backward's too: autograd carries the mode to its threads) and records a ``Violation`` (op,
what, the library line that asked for it) for each tensor created on another device than
``device`` or with a floating dtype outside ``dtypes``, and for each op that mixes
``device`` tensors with CPU tensors of more than 0 dims (CUDA refuses those); a companion
``TorchFunctionMode`` checks the tensors ``torch.tensor`` and the other constructors return.
Copies (``.cpu()``, ``.to(device)``), work on host data and the code that lives on the host
by design (``HOST_BY_DESIGN``, ``HOST_REGIONS``, each with its reason) are not violations.

On the meta device (the CPU machine's run: a tensor made without ``device=`` lands on the
CPU and stands out) nothing has values, so host reads are answered by ``MetaValues``
(``meta_values.py``). On a real device under torch's fake process group, what the group
never delivers is made harmless (``_fake_arrival``). ``placement_run.py`` runs a rank of a
layout under it.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import shardwise
from meta_values import MetaValues

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
        "partition by time: the profiling sample and times (on the CPU when the run is on "
        "the CPU or meta; on CUDA runs they are on the GPU and checked)",
    ("shardwise/data/", None):
        "the corpus, its tokens and the sampler's batches live on the host; the trainer "
        "moves each batch to the device",
    ("shardwise/apps/lm/trainer.py", "evaluate"):
        "the validation windows are cut from the host tokens, then moved to the device",
    ("shardwise/parallel/precision.py", "host_master"):
        "training.offload keeps the fp32 masters (and so AdamW's moments) in host memory, "
        "with \"optimizer+params\" ZeRO-3's compute-dtype parameter shards too",
    ("shardwise/parallel/offload.py", "to_host"):
        "training.offload's device-to-host gradient copies land in pinned host memory",
    ("torch/optim/adamw.py", "_init_group"):
        "torch's AdamW keeps its step count on the CPU unless fused or capturable",
    ("torch/optim/adam.py", "_init_group"):
        "torch's Adam keeps its step count on the CPU unless fused or capturable",
}

# Calls whose whole extent runs on the CPU by design, wherever in the stack.
HOST_REGIONS = {
    ("shardwise/engine/model.py", "_one_at_a_time"):
        "partition by time materialises each layer on the CPU (a private generator's "
        "draws) before moving it to where it is profiled",
    ("shardwise/parallel/pipeline/partition.py", "profile_layers"): "the same profiling",
}

# the library's own files: under its package directory (not any path that merely names a
# "shardwise" folder: a clone called shardwise holds .venv/.../torch too)
_SRC = os.path.dirname(os.path.abspath(shardwise.__file__)) + os.sep


def _ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_SRC)


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
        if _ours(f.filename):
            return f"{os.path.abspath(f.filename)[len(_SRC):]}:{f.lineno} in {f.name}"
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
        ours = [f for f in frames if _ours(f.filename)]
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
