"""Values for the few meta tensors whose values decide shapes (``MetaValues``), and the
answers to host reads on meta: what lets a whole training step run on the meta device."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map


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
