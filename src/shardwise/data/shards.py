"""Prepared token shards: the directory ``shardwise prepare`` writes and ``shardwise train
--data DIR`` memory-maps.

A prepared directory holds::

    manifest.json          what is there (below); written last, atomically
    tokenizer.json         the Hugging Face tokenizer (kind "hf"; a char vocabulary lives in
                           the manifest itself)
    train_00000.bin ...    raw little-endian token ids, no header: uint16 when the
    val_00000.bin   ...    vocabulary fits (V <= 65,536), else uint32

``manifest.json`` (``format`` "shardwise.tokens", ``version`` 1) gives ``dtype``,
``vocab_size``, ``tokenizer`` ({"kind": "char", "chars": ...} or {"kind": "hf", "file":
"tokenizer.json", "sha256": ..., "eos_id": ...}), the ``sources`` read, the counts
(``documents``, ``characters``, ``tokens`` per split), the ``split`` rule, and ``shards``:
per split, the files in order with their token count and sha256; chat data
(``shardwise prepare --chat``) add ``loss_mask``, the same per split for uint8 files aligned
with the tokens (1: a target, an assistant's token; 0: not). A split is the
concatenation of its shards: one stream of tokens, which the sampler cuts into windows as it
cuts a text's tokens.

Loading never unpickles: JSON and raw arrays mapped with ``np.memmap``. Only the pages of
the windows a rank indexes are read.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shardwise.base.files import replacing, temporary
from shardwise.data.corpus import DataError
from shardwise.data.tokenizer import CharTokenizer, HFTokenizer

FORMAT = "shardwise.tokens"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
UINT32_VOCAB = 2**32  # ids 0 .. 2**32 - 1

if TYPE_CHECKING:
    import torch


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 for ``vocab_size <= 65,536``, uint32 up to 2**32; ``DataError`` beyond."""
    if vocab_size <= 2**16:
        return np.dtype("<u2")
    if vocab_size <= UINT32_VOCAB:
        return np.dtype("<u4")
    raise DataError(f"a vocabulary of {vocab_size:,} tokens does not fit uint32 ids "
                    f"(at most {UINT32_VOCAB:,})")


def sha256_file(path: str | Path, chunk: int = 8 << 20) -> str:
    """Hex sha256 of a file, read in ``chunk``-byte pieces (bounded memory). The one file
    hash of the package: prepared shards and tokenizers here, a checkpoint's
    ``checksums.json`` in ``checkpoint.integrity`` (data precedes checkpoint in the layers
    of docs/architecture.md, so checkpoint may import it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: str | Path, obj) -> None:
    """Write ``obj`` as JSON to ``path`` so that a reader sees the old file or the whole
    new one, never a part, and both survive a power cut (``base.files.replacing``,
    durable)."""
    with replacing(path, durable=True) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, ensure_ascii=False)
            f.write("\n")


class ShardWriter:
    """Appends token arrays to ``DIR/NAME.tmp`` while hashing them; ``close()`` fsyncs and
    renames it to ``DIR/NAME`` and returns its manifest record ``{"file", "tokens",
    "sha256"}``."""

    def __init__(self, directory: Path, name: str, dtype: np.dtype):
        self.path = directory / name
        self.dtype = dtype
        self.tokens = 0
        self._hash = hashlib.sha256()
        self._f = open(temporary(self.path), "wb")

    def write(self, ids: np.ndarray) -> None:
        """Append ``ids`` (1-D) to the shard in the shard's dtype, hashing the bytes written."""
        data = np.ascontiguousarray(ids, dtype=self.dtype).tobytes()
        self._f.write(data)
        self._hash.update(data)
        self.tokens += len(ids)

    def close(self) -> dict:
        """Flush, fsync and move the shard to its final name; returns its manifest entry (``file``,
        ``tokens``, ``sha256``)."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._f.name, self.path)
        return {"file": self.path.name, "tokens": self.tokens, "sha256": self._hash.hexdigest()}

    def discard(self) -> None:
        """Close the unfinished shard and remove its temporary file."""
        self._f.close()
        Path(self._f.name).unlink(missing_ok=True)


class TokenStream:
    """One split's tokens, ``len(self)`` of them, as one stream over its memory-mapped shards.

    ``stream[idx]``: ``idx`` an int, a slice, or an integer tensor / array of any shape
    (global token positions, e.g. windows ``starts[:, None] + arange(T + 1)``); returns an
    int64 tensor of ``idx``'s shape, reading only those positions' pages. ``IndexError`` for
    a position outside ``[0, len)``."""

    def __init__(self, files: list[Path], counts: list[int], dtype: np.dtype):
        self.files, self.counts, self.dtype = list(files), list(counts), np.dtype(dtype)
        self._maps = [np.memmap(f, dtype=self.dtype, mode="r", shape=(n,)) if n else None
                      for f, n in zip(self.files, self.counts)]
        self._ends = np.cumsum(self.counts, dtype=np.int64)
        self._starts = self._ends - np.asarray(self.counts, dtype=np.int64)

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, idx) -> torch.Tensor:
        import torch  # here, not at the top: shardwise prepare writes shards without torch

        n = len(self)
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(n))
        scalar = isinstance(idx, (int, np.integer))
        pos = (idx.numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)).astype(np.int64)
        shape, flat = pos.shape, pos.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= n):
            raise IndexError(f"token position out of range [0, {n})")
        shard = np.searchsorted(self._ends, flat, side="right")
        out = np.empty(flat.shape, dtype=np.int64)
        for s in np.unique(shard):
            hit = shard == s
            out[hit] = self._maps[s][flat[hit] - self._starts[s]]
        t = torch.from_numpy(out.reshape(shape))
        return t.reshape(()) if scalar else t


@dataclass
class PreparedData:
    """A prepared directory opened for training: its manifest, tokenizer and the two
    splits as ``TokenStream``s."""

    root: Path
    manifest: dict
    tokenizer: CharTokenizer | HFTokenizer
    train: TokenStream
    val: TokenStream
    train_mask: TokenStream | None = None  # chat data: 1 where a token is a target
    val_mask: TokenStream | None = None


def is_prepared_dir(path: str | Path | None) -> bool:
    """Whether ``data.path`` names a directory (a prepared one, or a mistake that
    ``read_manifest`` will name), rather than a text file."""
    return path is not None and Path(path).is_dir()


def read_manifest(root: str | Path) -> dict:
    """``root``'s manifest; ``DataError`` (one line, naming the file) when it is missing,
    not JSON, or not this format and version."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        hint = (" (an unfinished prepare: run the same shardwise prepare again to finish it)"
                if (root / "prepare.json").is_file() else
                "; make one with: shardwise prepare FILES --tokenizer bpe --out " + str(root))
        raise DataError(f"data.path: {str(root)!r} holds no {MANIFEST}{hint}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"data.path: {path} is not JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"data.path: {path} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise DataError(f"data.path: {path} is version {manifest.get('version')}; this "
                        f"shardwise reads version {VERSION}")
    _check_shape(manifest, path)
    return manifest


def _check_shape(manifest: dict, path: Path) -> None:
    """The fields the readers index, of the right kinds, and file names that stay inside the
    directory; ``DataError`` (one line, naming the manifest) otherwise."""
    def bad(what: str) -> DataError:
        return DataError(f"data.path: {path} is damaged: {what}")

    def plain(name) -> bool:
        return isinstance(name, str) and name and "/" not in name and "\\" not in name \
            and name not in (".", "..")

    try:
        ok = np.dtype(manifest.get("dtype")) in (np.dtype(np.uint16), np.dtype(np.uint32))
    except TypeError:
        ok = False
    if not ok or manifest.get("dtype") is None:
        raise bad(f"dtype {manifest.get('dtype')!r}, expected uint16 or uint32")
    shards = manifest.get("shards")
    if not isinstance(shards, dict) or any(not isinstance(shards.get(s), list) for s in SPLITS):
        raise bad(f"shards must list the {' and '.join(SPLITS)} shards")
    masks = manifest.get("loss_mask")
    if masks is not None and (not isinstance(masks, dict)
                              or any(not isinstance(masks.get(s), list) for s in SPLITS)):
        raise bad(f"loss_mask must list the {' and '.join(SPLITS)} mask files")
    for split in SPLITS:
        for r in shards[split] + (masks[split] if masks is not None else []):
            if not (isinstance(r, dict) and plain(r.get("file"))
                    and isinstance(r.get("tokens"), int) and isinstance(r.get("sha256"), str)):
                raise bad(f"a {split} shard entry {r!r} (file: a plain name, tokens, sha256)")
        if masks is not None and sum(r["tokens"] for r in masks[split]) != sum(
                r["tokens"] for r in shards[split]):
            raise bad(f"loss_mask.{split} does not cover the {split} tokens one to one")

    def whole(v, least: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= least

    vocab = manifest.get("vocab_size")
    if not whole(vocab, 1):
        raise bad(f"vocab_size {vocab!r}, expected a whole number >= 1")
    if vocab > 2**(8 * np.dtype(manifest["dtype"]).itemsize):
        raise bad(f"vocab_size {vocab:,} does not fit dtype {manifest['dtype']}")
    counts = manifest.get("tokens")
    if not (isinstance(counts, dict) and all(whole(counts.get(s), 0) for s in SPLITS)):
        raise bad(f"tokens must give the {' and '.join(SPLITS)} token counts")
    for split in SPLITS:
        listed = sum(r["tokens"] for r in shards[split])
        if counts[split] != listed:
            raise bad(f"tokens.{split} is {counts[split]:,} but its shards hold {listed:,}")
    tok = manifest.get("tokenizer")
    if not (isinstance(tok, dict) and tok.get("kind") in ("char", "hf")):
        raise bad("tokenizer must be {kind: char | hf, ...}")
    if tok["kind"] == "hf" and not (plain(tok.get("file")) and isinstance(tok.get("sha256"), str)):
        raise bad("the hf tokenizer needs a plain file name and its sha256")
    if tok["kind"] == "char" and not (isinstance(tok.get("chars"), str) and tok["chars"]):
        raise bad("the char tokenizer needs its chars")
    eos = tok.get("eos_id")
    if eos is not None and not (whole(eos, 0) and eos < vocab):
        raise bad(f"tokenizer.eos_id {eos!r}, expected null or an id below vocab_size {vocab:,}")


def load_tokenizer(root: str | Path, manifest: dict) -> CharTokenizer | HFTokenizer:
    """The tokenizer a manifest names (``DataError`` if its file is missing or unreadable)."""
    spec = manifest["tokenizer"]
    path = Path(root) / (spec["file"] if spec["kind"] == "hf" else MANIFEST)
    try:
        if spec["kind"] == "char":
            tok = CharTokenizer(spec["chars"])
        else:
            tok = HFTokenizer.from_str(path.read_text(encoding="utf-8"), spec.get("eos_id"))
    except (OSError, ValueError) as e:
        raise DataError(f"data.path: {path}: {e}") from None
    if tok.vocab_size != manifest["vocab_size"]:  # the model is sized by the manifest's
        raise DataError(f"data.path: {Path(root) / MANIFEST} says vocab_size "
                        f"{manifest['vocab_size']:,}, but its tokenizer "
                        f"({path.name if spec['kind'] == 'hf' else 'tokenizer.chars'}) has "
                        f"{tok.vocab_size:,} ids; prepare it again")
    return tok


def verify(root: str | Path, manifest: dict | None = None, checksums: bool = True) -> dict:
    """Check every file the manifest lists: present, of the size its token count says, and
    (``checksums``) of its sha256. Returns the manifest; ``DataError`` naming the first
    file that fails. Reads every shard once when ``checksums`` (0.8 GB/s on the 2-core CPU,
    from the page cache)."""
    root = Path(root)
    manifest = manifest or read_manifest(root)
    itemsize = np.dtype(manifest["dtype"]).itemsize
    files = [(r["file"], r["tokens"] * itemsize, r["sha256"])
             for split in SPLITS for r in manifest["shards"][split]]
    files += [(r["file"], r["tokens"], r["sha256"])  # uint8 masks
              for split in SPLITS for r in manifest.get("loss_mask", {}).get(split, [])]
    if manifest["tokenizer"]["kind"] == "hf":
        t = manifest["tokenizer"]
        files.append((t["file"], None, t["sha256"]))
    for name, size, digest in files:
        path = root / name
        if not path.is_file():
            raise DataError(f"data.path: {path} is missing (listed in {MANIFEST})")
        if size is not None and path.stat().st_size != size:
            raise DataError(f"data.path: {path} holds {path.stat().st_size:,} bytes, "
                            f"{MANIFEST} says {size:,}; prepare it again")
        if checksums and (got := sha256_file(path)) != digest:
            raise DataError(f"data.path: {path}: checksum mismatch ({MANIFEST} says sha256 "
                            f"{digest[:12]}..., the file hashes to {got[:12]}...); prepare "
                            "it again")
    if checksums:  # at the door: the tokenizer reads, and its vocabulary is the manifest's
        load_tokenizer(root, manifest)
    return manifest


def load_prepared(root: str | Path, checksums: bool = False) -> PreparedData:
    """Open a prepared directory: manifest, tokenizer, and both splits memory-mapped.
    File sizes are always checked, checksums when asked (the CLI does it once, at the door,
    before any rank starts). ``DataError`` (one line) for anything missing or wrong."""
    root = Path(root)
    manifest = verify(root, checksums=checksums)
    dtype = np.dtype(manifest["dtype"])
    def stream(records: list[dict], dt) -> TokenStream:
        return TokenStream([root / r["file"] for r in records], [r["tokens"] for r in records], dt)

    streams = [stream(manifest["shards"][s], dtype) for s in SPLITS]
    masks = manifest.get("loss_mask")
    if masks is not None:
        streams += [stream(masks[s], np.uint8) for s in SPLITS]
    return PreparedData(root, manifest, load_tokenizer(root, manifest), *streams)
