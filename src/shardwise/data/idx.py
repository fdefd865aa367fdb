"""IDX files (LeCun's MNIST format, also Fashion-MNIST's), gzipped or raw, and the
Fashion-MNIST splits read from a directory.

IDX: a big-endian header ``0x00 0x00 <dtype code> <ndim>``, then ``ndim`` uint32 sizes,
then the values in C order (LeCun et al., http://yann.lecun.com/exdb/mnist/). Only uint8
data (code 0x08) is read; that is what MNIST and Fashion-MNIST hold.

Getting Fashion-MNIST (Xiao, Rasul & Vollgraf 2017, arXiv:1708.07747) on Debian/Ubuntu::

    apt install dataset-fashion-mnist      # -> /usr/share/datasets/fashion-mnist
    # or without root:
    apt-get download dataset-fashion-mnist && dpkg -x dataset-fashion-mnist_*.deb DIR
    # -> DIR/usr/share/datasets/fashion-mnist
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

from shardwise.data.corpus import DataError

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
EXPECTED = ", ".join(f"{n}[.gz]" for pair in FILES.values() for n in pair)


def read_idx(path: str | Path) -> torch.Tensor:
    """The uint8 array of one IDX file (``.gz`` read through gzip), shaped as its header
    says. Raises ``DataError`` naming the file if it is not uint8 IDX."""
    path = Path(path)
    try:
        raw = (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")).read()
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path}: not an IDX file of uint8 data (header {raw[:4].hex()})")
    ndim = raw[3]
    dims = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    start, count = 4 + 4 * ndim, int(np.prod(dims)) if dims else 0
    if len(raw) - start != count:
        raise DataError(f"{path}: header says {dims} = {count} values, file holds "
                        f"{len(raw) - start}")
    return torch.from_numpy(np.frombuffer(raw, np.uint8, count, start).reshape(dims).copy())


def _find(root: Path, name: str) -> Path:
    for candidate in (root / f"{name}.gz", root / name):
        if candidate.is_file():
            return candidate
    raise DataError(f"data.path: {str(root)!r} lacks {name}[.gz]; expected the Fashion-MNIST "
                    f"IDX files {EXPECTED} there (see docs/data.md: apt-get download "
                    "dataset-fashion-mnist)")


def check_image_dir(root: str | Path | None) -> Path:
    """The directory ``root`` (None: ``DEFAULT_DIR``) if every IDX file is there, else
    ``DataError`` naming the directory and the first missing file."""
    root = Path(root or DEFAULT_DIR).expanduser()
    for pair in FILES.values():
        for name in pair:
            _find(root, name)
    return root


def load_split(root: str | Path | None, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images, labels)`` of ``split`` ("train": 60,000, "test": 10,000 for
    Fashion-MNIST): images float32 (n, 1, 28, 28) scaled to [0, 1], labels int64 (n,)."""
    root = check_image_dir(root)
    img_name, lab_name = FILES[split]
    images, labels = read_idx(_find(root, img_name)), read_idx(_find(root, lab_name))
    if images.dim() != 3 or labels.dim() != 1 or len(images) != len(labels):
        raise DataError(f"{root}: {img_name} {tuple(images.shape)} and {lab_name} "
                        f"{tuple(labels.shape)} do not pair up as (n, rows, cols) and (n,)")
    return images.unsqueeze(1).float().div_(255.0), labels.long()


def write_idx(path: str | Path, array: torch.Tensor) -> Path:
    """Write a uint8 tensor as IDX (gzipped if ``path`` ends in .gz): tests and tools."""
    path = Path(path)
    a = array.to(torch.uint8).contiguous().numpy()
    data = bytes([0, 0, 0x08, a.ndim]) + b"".join(d.to_bytes(4, "big") for d in a.shape) + a.tobytes()
    (gzip.open if path.suffix == ".gz" else open)(path, "wb").write(data)
    return path
