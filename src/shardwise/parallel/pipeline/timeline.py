"""Pipeline timelines: record what each rank did when, measure the bubble, draw a Gantt chart.

An event is a dict ``{"rank", "kind" ("Forward" | "Backward" | ...), "mb", "chunk",
"start", "end"}`` with times in seconds. Measured timelines come from the executor
(``save`` writes ``RUN_DIR/timeline/rank{r}.json`` per rank); predicted ones from a schedule
alone (``predicted``, the ideal-machine simulation with backward = 2 x forward). Both draw
the same picture (``render``): ranks as rows, rank 0 on top, one box per forward / backward,
coloured by micro-batch (backwards darker) and labelled with it, like the figures of GPipe
and PipeDream; a split backward's timeline (zero-bubble schedules) colours F, B and W in
three colours instead, as the zero-bubble paper's figures do (a fused backward among them,
DualPipeV's, in a fourth: ``FUSED_COLOUR``).

Command line (``shardwise.cli.timeline``)::

    shardwise timeline RUN_DIR [--out PNG]
    shardwise timeline --predict 1f1b --pp 4 --micro-batches 8 [--chunks-per-rank 1] --out 1f1b.png
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from shardwise.base.files import save_figure, write_text
from shardwise.parallel.pipeline.schedules import compute_order, placement_of, time_orders
from shardwise.parallel.pipeline.stream import stream, time_stream

COMPUTE_KINDS = ("Forward", "Backward", "BackwardInput", "BackwardWeight")
SPLIT_COLOURS = {"Forward": "#4c72b0", "BackwardInput": "#dd8452", "BackwardWeight": "#55a868"}
FUSED_COLOUR = "#8172b3"  # a fused backward (B and W at once) in a split timeline
LETTER = {"Forward": "F", "Backward": "B", "BackwardInput": "B", "BackwardWeight": "W"}


def from_executor(executor, rank: int, offset: float = 0.0) -> list[dict]:
    """The executor's events of its last ``run`` as timeline events of row ``rank``."""
    return [{"rank": rank, "kind": k, "mb": mb, "chunk": c, "start": s - offset, "end": e - offset}
            for k, mb, c, s, e in executor.events]


def save(run_dir: str | Path, rank: int, events: list[dict], meta: dict | None = None) -> Path:
    """Write ``RUN_DIR/timeline/rank{rank}.json`` (``{"meta": ..., "events": [...]}``)."""
    path = Path(run_dir) / "timeline" / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text(path, json.dumps({"meta": meta or {}, "events": events}))


def load(run_dir: str | Path) -> tuple[list[dict], dict]:
    """All ranks' events and the first rank's meta. Raises ``FileNotFoundError`` (one line)."""
    files = sorted((Path(run_dir) / "timeline").glob("rank*.json"))
    if not files:
        raise FileNotFoundError(f"no timeline/rank*.json under {run_dir}")
    events, meta = [], {}
    for f in files:
        data = json.loads(f.read_text())
        events += data["events"]
        meta = meta or data.get("meta", {})
    return events, meta


def predicted(kind: str, p: int, m: int, v: int = 1, forward_cost: float = 1.0) -> list[dict]:
    """Events of ``schedule(kind, p, m, v)`` on an ideal machine (no communication time;
    chunk forward = ``forward_cost / v``, backward twice that). PipeDream: one steady-state
    step of its stream (``pipeline.stream``), from time 0."""
    if kind == "pipedream":
        s = stream(p, m)
        times = time_stream(s, s.steady_from + 1, forward_cost)[-1]
        t0 = min(b for b, _ in times.values())
        times = {op: (b - t0, e - t0) for op, (b, e) in times.items()}
    else:
        times = time_orders(compute_order(kind, p, m, v), p, v, forward_cost=forward_cost / v)
    place = placement_of(kind, p, v)
    return [{"rank": place[op.chunk], "kind": type(op).__name__, "mb": op.mb, "chunk": op.chunk,
             "start": s, "end": e} for op, (s, e) in times.items()]


def idle_fraction(events: Sequence[dict]) -> float:
    """Bubble: 1 - (compute time of all ranks) / (ranks x span of the step), where the span
    runs from the first compute start to the last compute end over all ranks."""
    comp = [e for e in events if e["kind"] in COMPUTE_KINDS]
    if not comp:
        return 0.0
    ranks = {e["rank"] for e in comp}
    span = max(e["end"] for e in comp) - min(e["start"] for e in comp)
    busy = sum(e["end"] - e["start"] for e in comp)
    return 1.0 - busy / (len(ranks) * span) if span > 0 else 0.0


def render(events: Sequence[dict], path: str | Path, title: str = "", unit: str = "s") -> Path:
    """Draw the Gantt chart of ``events`` to PNG ``path``; returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comp = [e for e in events if e["kind"] in COMPUTE_KINDS]
    if not comp:
        raise ValueError("no forward or backward events to draw")
    t0 = min(e["start"] for e in comp)
    scale, xlabel = (1e3, "time (ms)") if unit == "s" else (1.0, f"time ({unit})")
    ranks = sorted({e["rank"] for e in comp})
    n_mb = max(e["mb"] for e in comp) + 1
    cmap = plt.get_cmap("tab10" if n_mb <= 10 else "tab20")
    split = any(e["kind"] == "BackwardWeight" for e in comp)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.4), dpi=110)
    span = (max(e["end"] for e in comp) - t0) * scale
    for e in comp:
        row = len(ranks) - 1 - ranks.index(e["rank"])
        start, width = (e["start"] - t0) * scale, (e["end"] - e["start"]) * scale
        fwd = e["kind"] == "Forward"
        color = SPLIT_COLOURS.get(e["kind"], FUSED_COLOUR) if split else cmap(e["mb"] % cmap.N)
        alpha = 1.0 if split or not fwd else 0.55
        ax.barh(row, width, left=start, height=0.8, color=color, alpha=alpha,
                edgecolor="black", linewidth=0.5, hatch=None if e["chunk"] < len(ranks) else "//")
        if width > span / 90:
            label = f"{LETTER[e['kind']]}{e['mb']}"
            ax.text(start + width / 2, row, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in reversed(ranks)])
    ax.set_xlabel(xlabel)
    ax.set_xlim(0, span)
    bubble = idle_fraction(comp)
    hatched = ", hatched: second and later chunks" if any(e["chunk"] >= len(ranks) for e in comp) else ""
    colours = ("blue: F, orange: B (input gradient), green: W (weight gradient)" if split
               else "pale: forward, dark: backward")
    if split and any(e["kind"] == "Backward" for e in comp):
        colours += ", purple: fused B + W"
    ax.set_title(f"{title}  (idle fraction {bubble:.3f}; {colours}{hatched})".strip(),
                 fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return save_figure(fig, path)
    finally:
        plt.close(fig)
