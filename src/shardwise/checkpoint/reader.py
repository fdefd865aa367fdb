"""Read a DCP checkpoint without running anything from it.

``torch.distributed.checkpoint.FileSystemReader.read_metadata`` is ``pickle.load`` of
``.metadata``: a crafted file whose ``__reduce__`` names ``os.system`` runs it. ``SafeReader``
unpickles that file with ``MetadataUnpickler``, whose ``find_class`` admits only the classes a
DCP save of tensors writes (``Metadata``, ``TensorStorageMetadata``, ``ChunkStorageMetadata``,
``TensorProperties``, ``MetadataIndex``, ``StorageMeta``, ``_StorageInfo``, ``torch.Size``,
torch dtypes, layouts and memory formats, ``pathlib`` paths) and refuses every other global
before it is imported, the approach of ``torch.load(weights_only=True)`` and of the Python
docs' "Restricting Globals" recipe. The tensors themselves are read by DCP with
``torch.load(weights_only=True)``; byte items, which DCP would load with
``weights_only=False``, are refused, as are storage entries that point outside the
checkpoint's own files.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType

from shardwise.base.errors import CheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS = frozenset({
    (_DCP_METADATA, "Metadata"), (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"), (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "TensorStorageMetadata"), (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
})


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks for something loading must never do (run code, read elsewhere)."""


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only ``ALLOWED_GLOBALS`` and torch dtypes.

    Raises ``UnsafeCheckpointError`` naming the refused global (``posix.system`` ...).
    """

    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        """Resolve only torch.distributed.checkpoint's metadata classes and torch's dtypes, layouts
        and memory formats. Raises UnsafeCheckpointError for any other global (a crafted or foreign
        file)."""
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                           torch.memory_format)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.source}: refused to load: it names {module}.{name}, which is not one of "
            "torch.distributed.checkpoint's metadata classes (a crafted or foreign file)")


def safe_read_metadata(data: bytes, source: str) -> Metadata:
    """Unpickle DCP metadata bytes with ``MetadataUnpickler`` and check what came out.

    Raises ``UnsafeCheckpointError`` for a refused global or a non-tensor entry and
    ``CheckpointError`` for bytes that are not a pickle at all.
    """
    try:
        md = MetadataUnpickler(io.BytesIO(data), source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # truncated or random bytes
        raise CheckpointError(f"{source}: not DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointError(f"{source}: holds a {type(md).__name__}, not DCP Metadata")
    for key, value in md.state_dict_metadata.items():
        if not isinstance(value, TensorStorageMetadata):
            raise UnsafeCheckpointError(f"{source}: entry {key!r} is {type(value).__name__}; "
                                        "shardwise checkpoints hold tensors only")
    return md


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # a missing file: every tensor placed in it lies beyond its end


class SafeReader(FileSystemReader):
    """``FileSystemReader`` that never unpickles anything but DCP's metadata classes.

    ``files``: the data files the checkpoint may reference (its checksum manifest's list);
    ``None`` admits any plain file name inside the checkpoint directory.
    """

    def __init__(self, path: str | Path, files: Iterable[str] | None = None):
        super().__init__(str(path))
        self._dir = Path(path)
        self._files = None if files is None else frozenset(files)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata, unpickled with the allow-list. Raises UnsafeCheckpointError when it names
        a file outside this checkpoint or not in its manifest."""
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        md = safe_read_metadata((self._dir / name).read_bytes(), str(self._dir / name))
        sizes: dict[str, int] = {}
        for info in (md.storage_data or {}).values():
            rel = str(getattr(info, "relative_path", ""))
            ok = rel and "/" not in rel and "\\" not in rel and rel not in (".", "..")
            if not ok or (self._files is not None and rel not in self._files):
                raise UnsafeCheckpointError(f"{self._dir / name}: refers to {rel!r}, which is not "
                                            "a data file of this checkpoint")
            sizes[rel] = sizes.get(rel) or _size(self._dir / rel)
            end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
            if end > sizes[rel]:  # checked at the door: a foreign or damaged data file
                raise CheckpointError(f"{self._dir / rel}: holds {sizes[rel]:,} bytes, but "
                                      f"{name} places a tensor at bytes up to {end:,} (a data "
                                      "file replaced or cut)")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan, planner):
        """DCP's read, refusing non-tensor items (DCP would torch.load them with
        weights_only=False): UnsafeCheckpointError."""
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:  # DCP loads these with weights_only=False
                raise UnsafeCheckpointError(f"{self._dir}: {item.dest_index.fqn!r} is not a tensor; "
                                            "shardwise loads tensors only")
        return super().read_data(plan, planner)
