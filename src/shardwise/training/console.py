"""Status lines beside a progress bar, each on a line of its own.

On a terminal, rank 0's tqdm bar is redrawn in place (carriage returns, no newline), so a
line printed while it is live, or after a rank drew it and died (the launcher's "restart 1
of 3", the restarted rank's "resumed from ..."), lands inside the bar. ``status`` writes a
line above this process's live bar (``tqdm.write``: the bar cleared, the line, the bar
redrawn); with no live bar, on a terminal, it first clears what is left of the current line
(a dead process's bar: ANSI "erase in line", ``ESC [ K``); elsewhere (a log file, a pipe:
``training.loop.ProgressLines`` writes whole lines) it prints the line as it is. Imports
neither torch nor tqdm (the launcher's door uses it).
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

CLEAR_LINE = "\r\x1b[K"  # back to column 0, erase to the end of the line
_LIVE: list[Any] = []  # this process's live tqdm bars, innermost last


def status(line: str, file: TextIO | None = None) -> None:
    """Print ``line`` (no newline in it) on a line of its own on ``file`` (default
    stdout): above the live bar, after clearing a dead one, or plainly (see the module)."""
    stream = sys.stdout if file is None else file
    _LIVE[:] = [bar for bar in _LIVE if not bar.disable]  # tqdm's close sets disable
    if _LIVE:
        _LIVE[-1].write(line, file=stream)  # tqdm.write: clears the bars, writes, redraws
        stream.flush()
    elif _isatty(stream):
        stream.write(f"{CLEAR_LINE}{line}\n")
        stream.flush()
    else:
        print(line, file=stream, flush=True)


def live(bar: Any) -> Any:
    """Mark ``bar`` (a tqdm bar on a terminal) as live: ``status`` writes above it until it
    is closed. Returns ``bar``."""
    _LIVE.append(bar)
    return bar


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no such method, or a closed file
        return False
