"""The inputs of ``shardwise prepare``: local text, JSON-lines and Parquet files, streamed
through ``datasets`` (Hugging Face) as documents, pieces and blocks.

A document is a record of a JSONL / Parquet file (its ``field``), or a whole text file, read
line by line (line breaks kept) and cut into pieces of about ``piece_chars`` characters at
line ends. Pieces are grouped into blocks of at least ``block_chars`` characters, the unit
that ``data.prepare`` encodes, splits and resumes at. Memory: one block, plus what
``datasets`` holds while parsing (it reads ``READ_CHUNK`` bytes at a time).
"""

from __future__ import annotations

import codecs
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from shardwise.data.corpus import DataError

FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json",
           ".ndjson": "json", ".json": "json", ".parquet": "parquet"}
READ_CHUNK = 4 << 20  # bytes datasets parses at once (its default, 10 MB, costs memory)


@dataclass(frozen=True)
class Source:
    """One input file: its absolute ``path``, ``format`` (text, json, parquet), size in
    bytes and modification time (ns), which a resumed prepare must find unchanged."""

    path: str
    format: str
    bytes: int
    mtime_ns: int


def find_sources(inputs: list[str] | tuple[str, ...]) -> list[Source]:
    """The files ``inputs`` name, in order (a directory: its files of known formats,
    sorted). ``DataError`` (one line) for a missing path, an unknown suffix, an empty
    directory."""
    out: list[Source] = []
    for name in inputs:
        p = Path(name).expanduser()
        if p.is_dir():
            files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in FORMATS)
            if not files:
                raise DataError(f"{name}: a directory with no {', '.join(sorted(FORMATS))} files")
        elif p.is_file():
            files = [p]
        else:
            raise DataError(f"{name}: file not found")
        for f in files:
            fmt = FORMATS.get(f.suffix.lower())
            if fmt is None:
                raise DataError(f"{f}: unknown format {f.suffix or '(no suffix)'}; expected "
                                ".txt/.md (text), .jsonl/.json (JSON lines) or .parquet")
            st = f.stat()
            out.append(Source(str(f.resolve()), fmt, st.st_size, st.st_mtime_ns))
    if not out:
        raise DataError("no input files given")
    return out


def check_source(source: Source, field: str) -> None:
    """Before any work: a text or JSON file must be UTF-8 (read once, incrementally); a
    Parquet file must have the ``field`` column. ``DataError`` naming the file and the
    offset of the first bad byte."""
    if source.format == "parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(source.path).names
        except Exception as e:  # pyarrow's ArrowInvalid and friends
            reason = str(e).splitlines()[0]
            raise DataError(f"{source.path}: not a Parquet file ({reason})") from None
        if field not in names:
            raise DataError(f"{source.path}: no column {field!r} (columns: {', '.join(names)}); "
                            "--field NAME picks another")
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes read before this chunk
    with open(source.path, "rb") as f:
        while True:
            chunk = f.read(8 << 20)
            pending = decoder.getstate()[0]  # a sequence the last chunk cut, decoded now
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                bad = (pending + chunk)[e.start:e.start + 1].hex() or "a cut sequence"
                raise DataError(f"{source.path}: not UTF-8 (byte "
                                f"{offset - len(pending) + e.start:,} is {bad})") from None
            if not chunk:
                return
            offset += len(chunk)


def records(source: Source, field: str) -> Iterator[str]:
    """The rows ``datasets`` streams from one file: a text file's lines (line breaks kept),
    a JSONL / Parquet file's ``field`` values. ``DataError`` for a record without it."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never the hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    # CRITICAL: datasets logs a JSON parse error before raising it; we say it in one line
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    kwargs = {"text": {"keep_linebreaks": True, "chunksize": READ_CHUNK},
              "json": {"chunksize": READ_CHUNK}, "parquet": {"columns": [field]}}[source.format]
    column = "text" if source.format == "text" else field
    # cache_dir: datasets leaves a lock file per input in its cache even when streaming
    with tempfile.TemporaryDirectory(prefix="shardwise-prepare-") as cache:
        ds = datasets.load_dataset(source.format, data_files=[source.path], split="train",
                                   streaming=True, cache_dir=cache, **kwargs)
        yield from _values(ds, source, field, column)


def _values(ds, source: Source, field: str, column: str) -> Iterator[str]:
    n = 0
    try:
        for batch in ds.iter(batch_size=1024):
            values = batch.get(column)
            rows = len(next(iter(batch.values()))) if batch else 0
            for i in range(rows):
                v = values[i] if values is not None else None
                n += 1
                if not isinstance(v, str):
                    have = [k for k in batch if batch[k][i] is not None]
                    what = "has no field" if v is None else f"has a {type(v).__name__} in field"
                    raise DataError(f"{source.path}: {_where(source, n)} {what} {field!r} (its "
                                    f"fields: {', '.join(have) or 'none'}); --field NAME picks "
                                    "another")
                yield v
    except UnicodeDecodeError as e:
        raise DataError(f"{source.path}: not UTF-8 ({e.reason})") from None
    except DataError:
        raise
    except Exception as e:  # datasets' / pyarrow's parse errors: a line that is not JSON
        if source.format != "json":
            raise
        raise DataError(f"{source.path}: {_bad_json(source, e)}") from None


def _bad_json(source: Source, err: Exception) -> str:
    """What is wrong with a JSON-lines file ``datasets`` could not parse: its first line
    that is not a JSON object, else the parser's own first line. Read only on the error
    path."""
    import json

    with open(source.path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                return f"line {line_no} is not JSON ({e.msg}); expected one JSON object per line"
            if not isinstance(obj, dict):
                return (f"line {line_no} is a JSON {type(obj).__name__}; expected one JSON "
                        "object per line")
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return f"not readable as JSON lines ({reason})"


def _where(source: Source, n: int) -> str:
    """``line L`` of record ``n`` (1-based) of a JSON-lines file, whose blank lines
    ``datasets`` skips; ``record n`` of anything else. Read only on the error path."""
    if source.format != "json" or Path(source.path).suffix.lower() not in (".jsonl", ".ndjson"):
        return f"record {n}"
    seen = 0
    with open(source.path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            seen += bool(line.strip())
            if seen == n:
                return f"line {line_no}"
    return f"record {n}"


Piece = tuple[str, bool, int]  # (text, starts a document, source index)


def pieces(sources: list[Source], field: str, piece_chars: int,
           advance: Callable[[int], None]) -> Iterator[Piece]:
    """Every document's text in order, a text file cut into pieces of about
    ``piece_chars`` at line ends; empty documents skipped. ``advance(bytes)`` follows the
    reading (characters as an estimate, corrected at each file's end)."""
    for k, src in enumerate(sources):
        read = 0
        if src.format == "text":
            buf, size, first = [], 0, True
            for line in records(src, field):
                buf.append(line)
                size += len(line)
                if size >= piece_chars:
                    yield "".join(buf), first, k
                    advance(size)
                    read += size
                    buf, size, first = [], 0, False
            if buf:
                yield "".join(buf), first, k
        else:
            for text in records(src, field):
                if text:
                    yield text, True, k
                    advance(len(text))
                    read += len(text)
        advance(src.bytes - read)  # this file read: the exact total so far


def blocks(sources: list[Source], field: str, piece_chars: int, block_chars: int,
           advance: Callable[[int], None]) -> Iterator[list[Piece]]:
    """Pieces grouped into blocks of at least ``block_chars`` characters (the last may be
    smaller): the unit of encoding, splitting and resuming."""
    block, chars = [], 0
    for piece in pieces(sources, field, piece_chars, advance):
        block.append(piece)
        chars += len(piece[0])
        if chars >= block_chars:
            yield block
            block, chars = [], 0
    if block:
        yield block
