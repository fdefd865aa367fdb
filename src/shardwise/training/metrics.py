"""Run outputs: metrics as JSON lines and the loss-curve picture."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from shardwise.base.errors import storage_error
from shardwise.base.files import replacing, save_figure, temporary


class MetricsLog:
    """Appends one JSON object per line to ``path`` (rank 0 only writes)."""

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` to the file as one JSON line (nothing when not enabled). A
        failed write (a full disk) cuts the file back to its last whole line and raises
        ``StorageError`` naming the file and the errno."""
        if not self.enabled:
            return
        size = self.path.stat().st_size if self.path.is_file() else 0
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            with contextlib.suppress(OSError):  # no half row for the next append to glue to
                os.truncate(self.path, size)
            raise storage_error(e, self.path) from e


def truncate_metrics(path: str | Path, step: int) -> int:
    """Keep only the rows of ``path`` at or before ``step`` (a resumed run appends after
    them, so no step appears twice); rewritten atomically. Returns the rows dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:  # a row cut short by a crash
            pass
    if len(keep) != len(lines):
        tmp = temporary(path)  # replacing's, named in the error
        try:
            with replacing(path) as tmp:
                tmp.write_text("".join(line + "\n" for line in keep))
        except OSError as e:  # a full disk: the file as it was, no .tmp left
            raise storage_error(e, tmp, f"{path} is unchanged") from e
    return len(lines) - len(keep)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl`` file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_loss(metrics_path: str | Path, png_path: str | Path, title: str = "", *,
              unit: str) -> Path:
    """Draw train loss (per logged step) and validation loss against step into ``png_path``
    (replaced whole: a reader never sees half a file); ``unit``: what the loss is per,
    ``"token"`` or ``"char"`` (``apps.lm.text.token_unit``, as the CLI's lines say)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train"]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("kind") == "val"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"cross-entropy (nats / {unit})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    try:
        return save_figure(fig, png_path)
    finally:
        plt.close(fig)
