"""The package version, in one place."""

from __future__ import annotations

from pathlib import Path


def version() -> str:
    """The installed distribution's version (``importlib.metadata``), else the one in the
    source tree's ``pyproject.toml``, else "unknown"."""
    from importlib import metadata

    try:
        return metadata.version("shardwise")
    except metadata.PackageNotFoundError:
        pass
    import tomllib

    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"  # src/shardwise/base/
    try:
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"
