"""``shardwise prepare``: text files, JSONL or Parquet -> token shards and a manifest
(``data.shards`` describes the directory).

The corpus is streamed through ``datasets`` (one block of about ``block_chars`` characters
in memory at a time); documents (JSONL / Parquet records, or a whole text file) are joined
by the tokenizer's end-of-text token (``"\n\n"`` for ``char``); the tokenizer is ``char``,
a byte-level ``bpe`` trained here with ``tokenizers``' ``BpeTrainer``, or a
``tokenizer.json``; each block's tail goes to ``val`` so that the validation tokens so far
are ``floor(val_fraction * tokens so far)``. Restartable: complete shards are renamed into
place and ``prepare.json`` records the progress; a finished directory is refused. Details
(pieces, pre-tokenization, the split, the restart): docs/data.md, "How prepare works".
``--chat``: conversations and a loss mask (``prepare_chat``, ``data.chat``).
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from shardwise.base.files import fsync_dir
from shardwise.data.corpus import DataError
from shardwise.data.shards import (
    FORMAT,
    MANIFEST,
    SPLITS,
    TOKENIZER_FILE,
    UINT32_VOCAB,
    VERSION,
    ShardWriter,
    sha256_file,
    token_dtype,
    write_json_atomic,
)
from shardwise.data.sources import Piece, Source, blocks, check_source, find_sources
from shardwise.data.tokenizer import CharTokenizer, HFTokenizer

STATE = "prepare.json"
BPE_EOS = "<|endoftext|>"
EOS_CANDIDATES = (BPE_EOS, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
CHAR_SEPARATOR = "\n\n"
DEFAULT_BPE_VOCAB = 8192
MIN_BPE_VOCAB = 257  # 256 bytes + <|endoftext|>


@dataclass(frozen=True)
class PrepareOptions:
    """What ``shardwise prepare`` was asked. ``inputs``: files or directories (their
    ``.txt``/``.md``, ``.jsonl``/``.json``, ``.parquet`` files, sorted). ``tokenizer``:
    ``char``, ``bpe`` or a ``tokenizer.json`` path. ``vocab_size``: the BPE's (default
    8,192). ``field``: the text column of JSONL / Parquet. ``val_fraction``: share of tokens
    held out. ``shard_tokens``: tokens per train shard (about; a shard ends at a block's
    end). ``block_chars`` / ``piece_chars``: characters encoded at once / per text-file
    piece (the split and the shards depend on them; the manifest records them).
    ``progress``: show a progress bar per pass on stderr (None: when stderr is a terminal).
    ``chat``: the JSONL records are conversations, rendered with ``chat_template`` (a file;
    None: the tokenizer's ``tokenizer_config.json``) and written with a loss mask
    (``data.chat``)."""

    inputs: tuple[str, ...]
    out: str
    tokenizer: str = "bpe"
    vocab_size: int | None = None
    field: str = "text"
    val_fraction: float = 0.1
    shard_tokens: int = 1 << 24
    block_chars: int = 1 << 21
    piece_chars: int = 1 << 19
    progress: bool | None = None
    chat: bool = False
    chat_template: str | None = None


def _blocks(sources: list[Source], opts: PrepareOptions, advance) -> Iterator[list[Piece]]:
    return blocks(sources, opts.field, opts.piece_chars, opts.block_chars, advance)


# -- tokenizers --------------------------------------------------------------------------
def _bar(opts: PrepareOptions, total: int, desc: str, initial: int = 0):
    from tqdm import tqdm

    show = sys.stderr.isatty() if opts.progress is None else opts.progress
    # leave=False: the bar is erased when its pass ends, so an error is one line on stderr
    return tqdm(total=total, initial=initial, desc=desc, unit="B", unit_scale=True,
                unit_divisor=1024, dynamic_ncols=True, disable=not show, leave=False,
                mininterval=0.5 if sys.stderr.isatty() else 30.0)


def train_bpe(texts: Iterator[list[Piece]], vocab_size: int):
    """A byte-level BPE of ``vocab_size`` ids (fewer if the corpus has fewer merges) trained
    on the texts of the blocks ``texts`` with ``tokenizers.trainers.BpeTrainer``; id 0 is
    ``<|endoftext|>``. Pre-tokenization: a split after each newline, then GPT-2's byte-level
    regex (Radford et al. 2019), so no token spans a line break."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="merged_with_previous"),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(([text for text, _, _ in block] for block in texts), trainer=trainer)
    return tok


def find_eos(tokenizer) -> tuple[str, int] | tuple[None, None]:
    """The end-of-text token of a ``tokenizers.Tokenizer``: the first of
    ``EOS_CANDIDATES`` it knows, as ``(text, id)``; ``(None, None)`` if none."""
    for name in EOS_CANDIDATES:
        i = tokenizer.token_to_id(name)
        if i is not None:
            return name, i
    return None, None


class _Encoder:
    """Encodes blocks into one int64 array each, documents joined by the separator."""

    def __init__(self, tokenizer: CharTokenizer | HFTokenizer, documents_before: int):
        self.tokenizer = tokenizer
        self.documents = documents_before  # the first document of all gets no separator
        if isinstance(tokenizer, CharTokenizer):
            cps = np.frombuffer(tokenizer.chars.encode("utf-32-le"), dtype="<u4")
            self.lut = np.full(int(cps.max()) + 1, -1, dtype=np.int64)
            self.lut[cps] = np.arange(len(cps))

    def encode(self, block: list[Piece]) -> np.ndarray:
        if isinstance(self.tokenizer, CharTokenizer):
            return self._encode_chars(block)
        eos = self.tokenizer.eos_id
        encodings = self.tokenizer.tokenizer.encode_batch_fast(
            [text for text, _, _ in block], add_special_tokens=False)
        sep = np.array([eos] if eos is not None else [], dtype=np.int64)
        parts = []
        for (_, starts, _), enc in zip(block, encodings):
            if starts:
                if self.documents:
                    parts.append(sep)
                self.documents += 1
            parts.append(np.array(enc.ids, dtype=np.int64))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _encode_chars(self, block: list[Piece]) -> np.ndarray:
        texts = []
        for text, starts, _ in block:
            if starts:
                if self.documents:
                    texts.append(CHAR_SEPARATOR)
                self.documents += 1
            texts.append(text)
        cps = np.frombuffer("".join(texts).encode("utf-32-le"), dtype="<u4")
        ids = self.lut[np.minimum(cps, len(self.lut) - 1)]
        if len(cps) and (cps.max() >= len(self.lut) or ids.min() < 0):
            raise DataError("a character outside the char vocabulary: the inputs changed "
                            "since the vocabulary was built")
        return ids


def _char_vocabulary(sources, opts) -> CharTokenizer:
    chars: set[str] = set()
    documents = 0
    with _bar(opts, sum(s.bytes for s in sources), "read") as bar:
        for block in _blocks(sources, opts, bar.update):
            for text, starts, _ in block:
                chars.update(text)
                documents += starts
    if documents > 1:
        chars.update(CHAR_SEPARATOR)
    if not chars:
        raise DataError("the inputs hold no text")
    return CharTokenizer("".join(sorted(chars)))


# -- the output directory ----------------------------------------------------------------
def _identity(opts: PrepareOptions, sources: list[Source]) -> dict:
    """What a resumed prepare must find unchanged."""
    tok = opts.tokenizer
    if tok not in ("char", "bpe"):
        tok = {"file": str(Path(tok).resolve()), "sha256": sha256_file(tok)}
    return {"version": VERSION, "inputs": [asdict(s) for s in sources], "tokenizer": tok,
            "vocab_size": opts.vocab_size, "field": opts.field,
            "val_fraction": opts.val_fraction, "shard_tokens": opts.shard_tokens,
            "block_chars": opts.block_chars, "piece_chars": opts.piece_chars}


def _open_out(root: Path, identity: dict) -> dict | None:
    """The saved progress of an unfinished prepare of the same inputs (None: start);
    ``DataError`` refusing a finished, another or a foreign directory."""
    import json

    if (root / MANIFEST).exists():
        raise DataError(f"--out {root}: already holds a prepared dataset ({MANIFEST}); train "
                        f"on it with shardwise train --data {root}, or give another --out")
    state_path = root / STATE
    if state_path.is_file():
        try:
            state = json.loads(state_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DataError(f"--out {root}: {STATE} is unreadable ({e}); remove {root}") from None
        saved = state.get("identity", {})
        for key, value in identity.items():
            if saved.get(key) != value:
                what = "the input files changed" if key == "inputs" else f"{key} differs"
                raise DataError(f"--out {root}: holds an unfinished prepare of other inputs or "
                                f"options ({what}); give another --out, or remove {root}")
        return state
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise DataError(f"--out {root}: exists and is not an empty directory; give a new or "
                        "empty directory")
    return None


def _save_state(root: Path, state: dict) -> None:
    write_json_atomic(root / STATE, state)


def _tokenizer_spec(opts: PrepareOptions, sources, root: Path) -> tuple[dict, object]:
    """Build the tokenizer (a pass over the corpus for char and bpe) and its manifest
    record; an HF tokenizer is written to ``root/tokenizer.json``."""
    if opts.tokenizer == "char":
        tok = _char_vocabulary(sources, opts)
        return {"kind": "char", "chars": tok.chars, "separator": CHAR_SEPARATOR}, tok
    if opts.tokenizer == "bpe":
        with _bar(opts, sum(s.bytes for s in sources), "train bpe") as bar:
            raw = train_bpe(_blocks(sources, opts, bar.update),
                            opts.vocab_size or DEFAULT_BPE_VOCAB)
        raw.save(str(root / TOKENIZER_FILE))
        source = f"bpe trained here (asked vocab {opts.vocab_size or DEFAULT_BPE_VOCAB:,})"
    else:
        shutil.copyfile(opts.tokenizer, root / TOKENIZER_FILE)
        source = str(Path(opts.tokenizer).resolve())
    text = (root / TOKENIZER_FILE).read_text(encoding="utf-8")
    tok = HFTokenizer.from_str(text)
    eos_token, eos_id = find_eos(tok.tokenizer)
    tok.eos_id = eos_id
    return {"kind": "hf", "file": TOKENIZER_FILE, "sha256": sha256_file(root / TOKENIZER_FILE),
            "eos_token": eos_token, "eos_id": eos_id, "source": source}, tok


def check_options(opts: PrepareOptions) -> None:
    """The options alone (before reading anything): ``DataError``, one line."""
    if opts.tokenizer not in ("char", "bpe"):
        p = Path(opts.tokenizer)
        if not p.is_file():
            raise DataError(f"--tokenizer {opts.tokenizer}: not char, bpe, or an existing "
                            "tokenizer.json file")
        try:
            HFTokenizer.from_str(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise DataError(f"--tokenizer {opts.tokenizer}: {e}") from None
    if opts.vocab_size is not None:
        if opts.tokenizer != "bpe":
            raise DataError("--vocab-size: only with --tokenizer bpe (the others bring their "
                            "vocabulary)")
        if opts.vocab_size > UINT32_VOCAB:
            token_dtype(opts.vocab_size)  # raises: does not fit uint32
        if opts.vocab_size < MIN_BPE_VOCAB:
            raise DataError(f"--vocab-size {opts.vocab_size}: a byte-level BPE needs at least "
                            f"{MIN_BPE_VOCAB} (256 bytes + {BPE_EOS})")
    if opts.chat and opts.tokenizer in ("char", "bpe"):
        raise DataError("--chat: needs --tokenizer PATH/tokenizer.json (its chat template's "
                        "special tokens)")
    if opts.chat_template is not None and not opts.chat:
        raise DataError("--chat-template: only with --chat")
    if not 0.0 <= opts.val_fraction < 1.0:
        raise DataError(f"--val-fraction {opts.val_fraction}: expected 0 <= f < 1")
    for name in ("shard_tokens", "block_chars", "piece_chars"):
        if getattr(opts, name) < 1:
            raise DataError(f"--{name.replace('_', '-')}: expected a positive number")


# -- the whole command -------------------------------------------------------------------
@dataclass
class _Progress:
    blocks_done: int = 0
    documents: int = 0
    characters: int = 0
    tokens: dict = field(default_factory=lambda: {"train": 0, "val": 0})
    shards: dict = field(default_factory=lambda: {"train": [], "val": []})
    source_documents: list = field(default_factory=list)


MIN_BLOCK_CHARS = 1024


def _blocks_for_shards(opts: PrepareOptions) -> PrepareOptions:
    """``opts`` with blocks (and pieces) small enough for ``shard_tokens``: a shard ends at a
    block's end, so a block of at most ``shard_tokens / 4`` characters (one token a
    character at most) keeps a shard within 1.25 x ``shard_tokens`` (BPE: ~1.06 x); blocks
    of at least ``MIN_BLOCK_CHARS``, and ``opts`` unchanged when its blocks are small enough."""
    block = max(MIN_BLOCK_CHARS, opts.shard_tokens // 4)
    if block >= opts.block_chars:
        return opts
    return dataclasses.replace(opts, block_chars=block, piece_chars=min(opts.piece_chars, block))


def prepare(opts: PrepareOptions, log: Callable[[str], None] = print) -> dict:
    """Run ``shardwise prepare`` (module docstring); returns the manifest written to
    ``opts.out/manifest.json``. ``DataError`` (one line) for bad inputs or an ``--out`` it
    refuses; nothing half-written stays visible (a fresh run that fails removes what it
    wrote)."""
    check_options(opts)
    if opts.chat:
        return prepare_chat(opts)
    opts = _blocks_for_shards(opts)
    sources = find_sources(opts.inputs)
    for s in sources:
        check_source(s, opts.field)
    root = Path(opts.out).expanduser()
    identity = _identity(opts, sources)
    state = _open_out(root, identity)
    created = state is None and not root.exists()
    fresh = state is None
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # read-only, a file on the way, no permission
        raise DataError(f"--out {root}: cannot create it ({e.strerror or e})") from None
    try:
        if fresh:
            spec, tokenizer = _tokenizer_spec(opts, sources, root)
            progress = _Progress(source_documents=[0] * len(sources))
            state = {"identity": identity, "tokenizer": spec, "vocab_size": tokenizer.vocab_size,
                     "progress": asdict(progress)}
            token_dtype(tokenizer.vocab_size)  # a vocabulary beyond uint32 stops here
            _save_state(root, state)
        else:
            spec = state["tokenizer"]
            if spec["kind"] == "char":
                tokenizer = CharTokenizer(spec["chars"])
            else:
                path = root / spec["file"]
                if not path.is_file() or sha256_file(path) != spec["sha256"]:
                    raise DataError(f"--out {root}: {spec['file']} changed since the "
                                    f"unfinished prepare began; remove {root}")
                tokenizer = HFTokenizer.from_str(path.read_text(encoding="utf-8"), spec["eos_id"])
            progress = _Progress(**state["progress"])
            n = len(progress.shards["train"])
            log(f"shardwise prepare: resuming {root} after {n} complete train "
                f"shard{'s' if n != 1 else ''} ({progress.tokens['train']:,} tokens)")
        manifest = _encode_all(opts, sources, root, state, tokenizer, progress)
    except BaseException as e:
        # bad input: a fresh run leaves nothing behind; interrupted: the shards so far stay
        # for a resume, once the progress file exists
        if fresh and (isinstance(e, DataError) or not (root / STATE).exists()):
            _remove_outputs(root, created)
        raise
    write_json_atomic(root / MANIFEST, manifest)
    (root / STATE).unlink(missing_ok=True)
    fsync_dir(root)
    return manifest


def _remove_outputs(root: Path, created: bool) -> None:
    for f in root.iterdir():
        if f.name in (STATE, TOKENIZER_FILE, STATE + ".tmp") or f.suffix in (".bin", ".tmp"):
            f.unlink(missing_ok=True)
    if created and not any(root.iterdir()):
        root.rmdir()


def _encode_all(opts: PrepareOptions, sources: list[Source], root: Path, state: dict,
                tokenizer, progress: _Progress) -> dict:
    dtype = token_dtype(tokenizer.vocab_size)
    encoder = _Encoder(tokenizer, progress.documents)
    writers: dict[str, ShardWriter | None] = {s: None for s in SPLITS}
    total = sum(s.bytes for s in sources)

    def write(split: str, ids: np.ndarray) -> None:
        if len(ids):
            if writers[split] is None:
                name = f"{split}_{len(progress.shards[split]):05d}.bin"
                writers[split] = ShardWriter(root, name, dtype)
            writers[split].write(ids)

    def close_shards() -> None:
        for split in SPLITS:
            if writers[split] is not None:
                progress.shards[split].append(writers[split].close())
                writers[split] = None

    try:
        with _bar(opts, total, "encode") as bar:
            for i, block in enumerate(_blocks(sources, opts, bar.update)):
                if i < progress.blocks_done:
                    continue  # resuming: these blocks are in the shards already
                ids = encoder.encode(block)
                for text, starts, k in block:
                    progress.characters += len(text)
                    progress.source_documents[k] += starts
                progress.documents = encoder.documents
                before = progress.tokens["train"] + progress.tokens["val"]
                n_val = (int((before + len(ids)) * opts.val_fraction)
                         - int(before * opts.val_fraction))
                cut = len(ids) - n_val
                write("train", ids[:cut])
                write("val", ids[cut:])
                progress.tokens["train"] += cut
                progress.tokens["val"] += n_val
                progress.blocks_done = i + 1
                if writers["train"] is not None and writers["train"].tokens >= opts.shard_tokens:
                    close_shards()  # a restart point: every shard so far complete
                    _save_state(root, {**state, "progress": asdict(progress)})
        close_shards()
    finally:
        for w in writers.values():
            if w is not None:
                w.discard()
    if progress.tokens["train"] == 0:
        raise DataError("the inputs hold no text")
    spec = state["tokenizer"]
    return {
        "format": FORMAT, "version": VERSION,
        "dtype": dtype.name, "vocab_size": tokenizer.vocab_size, "tokenizer": spec,
        "field": opts.field,
        "sources": [{"path": s.path, "format": s.format, "bytes": s.bytes, "documents": d}
                    for s, d in zip(sources, progress.source_documents)],
        "documents": progress.documents, "characters": progress.characters,
        "tokens": dict(progress.tokens),
        "split": {"val_fraction": opts.val_fraction, "block_chars": opts.block_chars,
                  "piece_chars": opts.piece_chars,
                  "rule": "val: the tail of each block, so that val tokens so far = "
                          "floor(val_fraction * tokens so far)"},
        "shards": progress.shards,
        "created_by": _created_by(),
    }


def _created_by() -> str:
    from shardwise.base.version import version

    return f"shardwise {version()} prepare"


# -- chat data ---------------------------------------------------------------------------
def prepare_chat(opts: PrepareOptions) -> dict:
    """``shardwise prepare --chat``: every JSONL record a conversation (``data.chat``),
    rendered, encoded and joined by the end-of-text id (not a target); the shards of
    tokens and beside them ``{split}_mask_NNNNN.bin`` (uint8, 1: a target). The split rule
    is the text path's, over the whole corpus at once (in memory; not restartable).
    Returns the manifest."""
    import json

    from shardwise.data import chat

    sources = find_sources(opts.inputs)
    for s in sources:
        if s.format != "json":
            raise DataError(f"--chat: {s.path} is not JSONL")
    root = Path(opts.out).expanduser()
    _open_out(root, _identity(opts, sources))
    if (root / STATE).exists():
        raise DataError(f"--out {root}: holds an unfinished prepare; remove {root}")
    template = chat.load_template(opts.tokenizer, opts.chat_template)
    tok = HFTokenizer.from_str(Path(opts.tokenizer).read_text(encoding="utf-8"))
    eos_token, eos_id = find_eos(tok.tokenizer)
    if eos_id is None:
        raise DataError(f"--tokenizer {opts.tokenizer}: no end-of-text token (one of "
                        f"{', '.join(EOS_CANDIDATES)}) to end each conversation")
    ids, mask, counts, chars = [], [], [], 0
    for s in sources:
        n = 0
        with open(s.path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{s.path}:{line_no}"
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{where}: not JSON ({e})") from None
                text, spans = chat.render(chat.conversation(record, where), template, where)
                enc = tok.tokenizer.encode(text, add_special_tokens=False)
                if ids:
                    ids.append(np.array([eos_id], dtype=np.int64))
                    mask.append(np.zeros(1, dtype=np.uint8))
                ids.append(np.array(enc.ids, dtype=np.int64))
                mask.append(chat.target_mask(enc.offsets, spans))
                chars, n = chars + len(text), n + 1
        counts.append(n)
    if not ids:
        raise DataError("the inputs hold no conversations")
    ids, mask = np.concatenate(ids), np.concatenate(mask)
    if not mask.any():
        raise DataError("--chat: no assistant turn in the inputs: nothing to train on")
    cut = len(ids) - int(len(ids) * opts.val_fraction)
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tok.vocab_size)
    try:
        shutil.copyfile(opts.tokenizer, root / TOKENIZER_FILE)
        shards, masks = {}, {}
        for split, part in (("train", slice(0, cut)), ("val", slice(cut, None))):
            shards[split], masks[split] = [], []
            for name, arr, dt, out in ((split, ids, dtype, shards), (f"{split}_mask", mask,
                                        np.dtype(np.uint8), masks)):
                if len(arr[part]):
                    w = ShardWriter(root, f"{name}_00000.bin", dt)
                    w.write(arr[part])
                    out[split].append(w.close())
        spec = {"kind": "hf", "file": TOKENIZER_FILE,
                "sha256": sha256_file(root / TOKENIZER_FILE), "eos_token": eos_token,
                "eos_id": eos_id, "source": str(Path(opts.tokenizer).resolve())}
        manifest = {
            "format": FORMAT, "version": VERSION, "dtype": dtype.name,
            "vocab_size": tok.vocab_size, "tokenizer": spec, "field": "messages",
            "sources": [{"path": s.path, "format": s.format, "bytes": s.bytes, "documents": d}
                        for s, d in zip(sources, counts)],
            "documents": sum(counts), "characters": chars,
            "tokens": {"train": cut, "val": len(ids) - cut},
            "split": {"val_fraction": opts.val_fraction,
                      "rule": "val: the corpus's tail, floor(val_fraction * tokens)"},
            "shards": shards,
            "loss_mask": masks,
            "chat_template": {"source": opts.chat_template or "tokenizer_config.json",
                              "targets": int(mask.sum())},
            "created_by": _created_by(),
        }
    except BaseException:
        _remove_outputs(root, created)
        raise
    write_json_atomic(root / MANIFEST, manifest)
    return manifest
