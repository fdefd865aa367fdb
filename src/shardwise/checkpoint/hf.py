"""Hugging Face checkpoint directories on disk: ``config.json`` and safetensors files.

A directory as ``transformers``' ``save_pretrained`` writes it: ``config.json``, and either
one ``model.safetensors`` or several shards listed by ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}``). Reading goes
through ``safetensors.safe_open``, which maps the file and reads only the bytes of the
slice asked for (``get_slice(name)[index]``): a rank loading its tensor-parallel slice of a
matrix reads that slice, not the matrix. safetensors files hold raw tensor bytes and a JSON
header; nothing in them is executed on load (unlike a pickled ``pytorch_model.bin``, which
is not read here).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardwise.base.errors import CheckpointError
from shardwise.base.files import replacing, write_text

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class HFCheckpointError(CheckpointError):
    """A Hugging Face checkpoint directory that cannot be read; one line naming the file."""


def _safetensors():
    try:
        import safetensors
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise HFCheckpointError("Hugging Face checkpoints need the safetensors package: "
                                "pip install safetensors") from None
    return safetensors


def read_config(path: str | Path) -> dict:
    """``DIR/config.json`` as a dict; ``HFCheckpointError`` (one line) when the directory
    or the file is missing or the file is not a JSON object."""
    path = Path(path)
    if not path.is_dir():
        raise HFCheckpointError(f"{path}: no such directory")
    f = path / CONFIG
    if not f.is_file():
        raise HFCheckpointError(f"{path}: no {CONFIG} there (a Hugging Face checkpoint "
                                "directory holds config.json and *.safetensors)")
    try:
        out = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFCheckpointError(f"{f}: not readable JSON ({e})") from None
    if not isinstance(out, dict):
        raise HFCheckpointError(f"{f}: not a JSON object")
    return out


class SafetensorsDir:
    """The tensors of a Hugging Face checkpoint directory, read slice by slice.

    ``names()``, ``shape(name)`` (from the files' headers, nothing else read), ``read(name,
    index)`` (the slice ``index``, a tuple of slices, as a CPU tensor of the file's dtype);
    ``listing``: the file that lists the tensors (the index, or the one safetensors file).
    Files are opened on first use and kept open (memory-mapped) until ``close()``. Raises
    ``HFCheckpointError`` (one line) when no safetensors file is there, the index names a
    missing file, or a tensor is not in the checkpoint.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._st = _safetensors()
        self._handles: dict[str, object] = {}
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise HFCheckpointError(f"{index}: not a safetensors index ({e})") from None
            self._file_of = {str(k): str(v) for k, v in weight_map.items()}
            self.listing = index
            for f in sorted(set(self._file_of.values())):
                if "/" in f or "\\" in f or not (self.path / f).is_file():
                    raise HFCheckpointError(f"{index}: lists {f!r}, which is not a file of "
                                            f"{self.path}")
        elif (self.path / SINGLE).is_file():
            self._file_of = {n: SINGLE for n in self._open(SINGLE).keys()}
            self.listing = self.path / SINGLE
        else:
            raise HFCheckpointError(f"{self.path}: no {SINGLE} or {INDEX} there (a pickled "
                                    "pytorch_model.bin is not read: convert it to safetensors)")

    def _open(self, file: str):
        handles = self._handles
        if file not in handles:
            try:
                handles[file] = self._st.safe_open(str(self.path / file), framework="pt")
            except Exception as e:  # a truncated or foreign file
                raise HFCheckpointError(f"{self.path / file}: not a safetensors file "
                                        f"({type(e).__name__}: {e})") from None
        return handles[file]

    def names(self) -> list[str]:
        """The names of every tensor in the checkpoint (over all its files)."""
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _slice(self, name: str):
        if name not in self._file_of:
            raise HFCheckpointError(f"{self.path}: no tensor {name!r} in the checkpoint")
        file = self._file_of[name]
        try:
            return self._open(file).get_slice(name)
        except HFCheckpointError:
            raise
        except Exception:  # safetensors' SafetensorError: the index and the file disagree
            raise HFCheckpointError(f"{self.path / file}: holds no tensor {name!r}, which "
                                    f"{self.listing.name} places there") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` as stored, read from the header only."""
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """The slice ``index`` of tensor ``name`` (all of it for ``()``)."""
        s = self._slice(name)
        if not index:
            index = tuple(slice(None) for _ in s.get_shape())
        return s[index]

    def close(self) -> None:
        """Drop the open safetensors handles (their files unmap when collected)."""
        self._handles.clear()  # safe_open handles unmap when collected


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor],
                      max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write ``tensors`` (contiguous CPU tensors, none sharing memory) into ``path`` as
    ``model.safetensors``, or, above ``max_shard_bytes``, as shards
    ``model-0000i-of-0000n.safetensors`` filled in order up to that size (a tensor larger
    than it gets a shard of its own) plus ``model.safetensors.index.json``; each file is
    written under a temporary name and renamed into place. Returns the file names (the
    index last)."""
    st = _safetensors()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    if len(shards) == 1:
        names = [SINGLE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        with replacing(path / name) as tmp:
            st.torch.save_file(shard, str(tmp), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for t in tensors.values())},
                 "weight_map": {t: f for f, shard in zip(names, shards) for t in shard}}
        write_text(path / INDEX, json.dumps(index, indent=2) + "\n")
        names.append(INDEX)
    return names
