"""``shardwise prepare``: tokenize a corpus into token shards and a manifest, for
``shardwise train --data DIR`` (``shardwise.data.prepare`` does the work).

Examples::

    shardwise prepare corpus.jsonl --tokenizer bpe --vocab-size 8192 --out data/mine
    shardwise prepare books/ notes.txt --tokenizer char --out data/chars
    shardwise prepare docs.parquet --field body --tokenizer path/to/tokenizer.json --out data/hf
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence

from shardwise.cli.common import EXIT_USAGE, Parser, whole_number


def _fraction(text: str) -> float:
    import argparse

    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def build_parser() -> Parser:
    """The parser of ``shardwise prepare DATA... --tokenizer ... --out DIR``."""
    ap = Parser(prog="shardwise prepare",
                description="Tokenize text files, JSONL or Parquet (read with datasets, "
                "streaming) into token shards plus manifest.json in DIR, for shardwise train "
                "--data DIR. Run again into the same DIR: an unfinished prepare resumes, a "
                "finished one is refused.")
    ap.add_argument("data", nargs="+", metavar="DATA",
                    help="files or directories: .txt/.md (text), .jsonl/.json, .parquet")
    ap.add_argument("--tokenizer", required=True, metavar="char|bpe|PATH",
                    help="char: one id per character; bpe: train a byte-level BPE here; or "
                         "the path of a Hugging Face tokenizer.json")
    ap.add_argument("--vocab-size", type=whole_number(1), metavar="N",
                    help="the BPE's vocabulary (default 8192; --tokenizer bpe only)")
    ap.add_argument("--field", default="text", metavar="NAME",
                    help="the text field of JSONL / Parquet records (default text)")
    ap.add_argument("--out", required=True, metavar="DIR", help="output directory")
    ap.add_argument("--val-fraction", type=_fraction, default=0.1, metavar="F",
                    help="tokens held out for validation, spread over the corpus (default 0.1)")
    ap.add_argument("--shard-tokens", type=whole_number(1), default=1 << 24, metavar="N",
                    help="tokens per train shard, about (default 16,777,216); a restart "
                         "resumes after the last complete shard")
    ap.add_argument("--chat", action="store_true",
                    help="JSONL conversations (messages, or prompt/response): rendered with "
                         "the tokenizer's chat template, only the assistant's tokens targets")
    ap.add_argument("--chat-template", metavar="FILE", default=None,
                    help="a Jinja chat template (default: the chat_template of the "
                         "tokenizer_config.json beside --tokenizer)")
    ap.add_argument("--no-progress", action="store_true",
                    help="no progress bar (shown when stderr is a terminal)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``shardwise prepare``; returns 0, or 2 with one line on stderr for bad input or an
    ``--out`` it refuses."""
    args = build_parser().parse_args(argv)
    from shardwise.base.words import count
    from shardwise.data.corpus import DataError
    from shardwise.data.prepare import PrepareOptions, prepare

    opts = PrepareOptions(inputs=tuple(args.data), out=args.out, tokenizer=args.tokenizer,
                          vocab_size=args.vocab_size, field=args.field,
                          val_fraction=args.val_fraction, shard_tokens=args.shard_tokens,
                          progress=False if args.no_progress else None, chat=args.chat,
                          chat_template=args.chat_template)
    try:
        m = prepare(opts, log=lambda line: print(line, file=sys.stderr, flush=True))
    except DataError as e:
        print(f"shardwise prepare: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    t = m["tokenizer"]
    kind = "char" if t["kind"] == "char" else ("bpe" if t["source"].startswith("bpe") else
                                              "tokenizer.json")
    n_shards = len(m["shards"]["train"]) + len(m["shards"]["val"])
    print(f"shardwise prepare: {count(m['documents'], 'document')}, "
          f"{count(m['characters'], 'character')} "
          f"-> {m['tokens']['train']:,} train + {m['tokens']['val']:,} val tokens ({kind}, "
          f"vocab {m['vocab_size']:,}, {m['dtype']}) in {n_shards} shards; "
          f"shardwise train --data {shlex.quote(str(args.out))}")
    return 0
