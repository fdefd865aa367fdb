"""Status lines on a terminal, each on a line of its own (``training.console.status``): above
rank 0's live tqdm bar, and after the bar a killed rank left half-drawn (the launcher's
restart line). What a person sees is read through a small terminal model: carriage return,
newline, erase-in-line (``ESC [ K``) and cursor-up (``ESC [ A``, tqdm's)."""

import io
import re
import signal
import sys

from shardwise import launch
from shardwise.base.config import Config
from shardwise.training import loop
from shardwise.training.console import status


class _Terminal(io.StringIO):
    """A stream that says it is a terminal (tqdm then draws its live bar on it)."""

    def isatty(self) -> bool:
        return True


def _screen(text: str) -> list[str]:
    """The lines a terminal shows after ``text``."""
    lines, row, col = [""], 0, 0
    for token in re.findall(r"\x1b\[(\d*)([A-Za-z])|(\r)|(\n)|([^\x1b\r\n])", text):
        n, code, cr, nl, ch = token
        if cr:
            col = 0
        elif nl:
            row, col = row + 1, 0
            if row == len(lines):
                lines.append("")
        elif code == "K":
            lines[row] = lines[row][:col]
        elif code == "A":
            row = max(0, row - int(n or 1))
        elif ch:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + ch + line[col + 1:]
            col += 1
    return [line.rstrip() for line in lines if line.strip()]


def test_a_status_line_lands_above_the_live_bar_on_its_own_line(monkeypatch):
    """A line written while rank 0's bar is live (a replica group's "healed from ...", an
    evaluation, the first lines of a run) is a whole line of the screen; the bar is drawn
    again below it and goes on counting."""
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(sys, "stdout", term)
    bar = loop.progress_bar(10, 0)
    bar.update(3)
    bar.refresh()
    status("shardwise: healed from replica group 1 at step 3", file=sys.stderr)
    status("step 3: val_loss=2.5")  # stdout, the same terminal
    bar.update(2)
    bar.close()
    screen = _screen(term.getvalue())
    assert "shardwise: healed from replica group 1 at step 3" in screen, screen
    assert "step 3: val_loss=2.5" in screen, screen
    assert screen[-1].startswith("train:") and "5/10" in screen[-1], screen
    status("after the bar")  # closed: plain lines again
    assert _screen(term.getvalue())[-1] == "after the bar"


def test_the_launchers_restart_line_is_not_glued_to_a_dead_ranks_bar(monkeypatch, tmp_path):
    """A rank killed while rank 0's bar was half-drawn on the terminal: the launcher's
    "restart 1 of 1" (and what follows) starts a line of its own, not the dead bar's."""
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(sys, "stdout", term)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # pytest's handlers stay
    calls = []

    def spawn(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:  # rank 0 drew its bar (no newline), then a rank was killed
            sys.stderr.write("\rtrain:  30%|###       | 90/300 [00:09<00:21, 9.8step/s]")
            raise launch.WorkerError("rank 1 died of SIGKILL")
        raise launch.Interrupted(signal.SIGINT)  # the second gang: stopped, to end the test

    monkeypatch.setattr(launch, "spawn", spawn)
    cfg = Config.from_dict({"training": {"out_dir": str(tmp_path / "run")}})
    from shardwise.cli.main import _run_local

    assert _run_local(cfg, False, max_restarts=1, device="cpu") == 128 + signal.SIGINT
    screen = _screen(term.getvalue())
    assert "shardwise: rank 1 died of SIGKILL; restart 1 of 1" in screen, screen
    assert screen[-1].startswith("shardwise: stopped by SIGINT"), screen
