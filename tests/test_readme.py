"""The README is a front door (issue 39): at most 300 lines, none over 200 characters; the
reference material lives in docs/ (its links are checked by tests/test_cli.py). And it is a
script (issue 41): its shell commands, run in order on a fresh copy of the repository, all
succeed, and no two write the same run directory, token shards or config file."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO

SHELL_BLOCKS = ("bash", "sh", "console", "shell")

# commands the test machine cannot run, by their first words, with the reason
SKIPPED = {
    "pip install": "installs packages from the network (the test runs in an installed one)",
    "make test": "the test suite itself",
    "torchrun --nnodes 2": "two machines (tests/test_torchrun.py, tests/test_hosts.py: on one)",
}
# run in the slow set only: they read and write nothing (no collision possible), cost ~10 s of
# CPU together, and other tests check their figures
SLOW_ONLY = {
    "shardwise plan --model megatron-1t": "the planner at 3,072 GPUs (test_planner_search.py)",
    "shardwise memory --params 7.5e9": "ZeRO's memory formulas (test_planner.py)",
}
# commands run as what they stand for: `make run` would create .venv from the network; its
# recipe's command instead (`$(VENV)/bin/shardwise train ...` in the Makefile)
_RUN = re.search(r"^run:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
REPLACED = {"make run": _RUN.group(1).replace("$(VENV)/bin/", "") if _RUN else "make run"}

# appended to every `shardwise train` (the last value of a field wins): seconds, not minutes
TRAIN_SHRINK = ("--training.steps", "2", "--training.eval_batches", "1",
                "--training.sample_chars", "8")

# the input the README's own-data command reads (its reader brings their own)
CORPUS = "my_corpus.jsonl"


def readme_commands(text: str) -> list[str]:
    """The logical command lines of the README's shell blocks, in order (a trailing
    backslash joins the next line; ``$ `` prompts of console blocks dropped)."""
    commands, block, pending = [], None, ""
    for line in text.splitlines():
        fence = re.match(r"^```(\w*)\s*$", line)
        if fence:
            block = None if block is not None else fence.group(1)
            continue
        if block not in SHELL_BLOCKS:
            continue
        line = line.removeprefix("$ ") if block == "console" else line
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.strip() and not line.lstrip().startswith("#"):
            commands.append(line.strip())
    return commands


def _first_words(argv: list[str], table: dict[str, str]) -> str | None:
    words = " ".join(argv)
    return next((why for start, why in table.items() if words.startswith(start)), None)


def shrunk(argv: list[str]) -> list[str]:
    """The command as the test runs it: ``make run`` as its recipe, train runs shortened."""
    argv = shlex.split(REPLACED.get(" ".join(argv), shlex.join(argv)))
    if argv[:2] == ["shardwise", "train"]:
        argv = argv + list(TRAIN_SHRINK)
    return argv


def _train_args(argv: list[str]) -> list[str] | None:
    """The arguments after ``train`` of a ``shardwise train`` (or ``-m shardwise train``)."""
    for i in range(len(argv) - 1):
        if argv[i].endswith("shardwise") and argv[i + 1] == "train":
            return argv[i + 2:]
    return None


def _out_dir(train_args: list[str], cwd: Path) -> tuple[str, str]:
    """The run and checkpoint directories of ``shardwise train ARGS``, as its door has them."""
    from shardwise.base.config import Config
    from shardwise.cli.common import split_overrides

    rest, config = list(train_args), "configs/shakespeare.toml"
    for flag in ("--config", "--data", "--max-restarts"):
        if flag in rest:
            i = rest.index(flag)
            config = rest[i + 1] if flag == "--config" else config
            del rest[i:i + 2]
    rest = [a for a in rest if a not in ("--fresh", "--resume")]
    cfg = Config.load(cwd / config, split_overrides(rest))
    return str(Path(cfg.training.out_dir)), str(cfg.checkpoint_dir)


def test_the_readme_is_short_and_its_lines_readable():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300: detail to docs/)"
    long = [f"{i}: {len(line)} characters" for i, line in enumerate(lines, 1) if len(line) > 200]
    assert not long, "README.md lines over 200 characters:\n" + "\n".join(long)


def test_readme_commands_are_found():
    """The extraction sees the README's commands (a test that runs none cannot fail)."""
    cmds = readme_commands((REPO / "README.md").read_text(encoding="utf-8"))
    assert sum(c.startswith("shardwise train") for c in cmds) >= 4, cmds
    assert any(c.startswith("shardwise plan") and "--emit-toml" in c for c in cmds), cmds
    text = "```bash\na \\\n  b  # c\n```\n```python\nx\n```\n```console\n$ d\n```\n"
    assert readme_commands(text) == ["a    b  # c", "d"]


def test_every_readme_training_command_has_a_run_directory_of_its_own():
    """Each ``shardwise train`` of the README (the skipped ones too: torchrun's) resolves to
    an ``out_dir`` and a checkpoint directory no other one uses, so none resumes another's
    run or is refused for a model that differs (issue 41, friction 1)."""
    seen: dict[str, str] = {}
    for line in readme_commands((REPO / "README.md").read_text(encoding="utf-8")):
        args = _train_args(shrunk(shlex.split(line, comments=True)))
        if args is None or "best.toml" in args:  # best.toml: the run test (plan writes it)
            continue
        for where in _out_dir(args, REPO):
            assert where not in seen, f"{line}\nwrites {where}, as `{seen[where]}` does"
            seen[where] = line
    assert len(seen) >= 10, seen


def _fresh_copy(dest: Path) -> None:
    """The repository's files as a clone has them, with this tree's uncommitted changes:
    tracked and untracked-but-not-ignored files (no runs/, .venv, caches)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, check=True).stdout
    for name in out.decode().split("\0"):
        src = REPO / name
        if name and src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _shim(bin_dir: Path, src: Path) -> None:
    """``shardwise`` on PATH: this interpreter running the copy's package."""
    bin_dir.mkdir()
    exe = bin_dir / "shardwise"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="{src}" exec "{sys.executable}" -m shardwise "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


def _corpus(path: Path) -> None:
    """400 lines of JSON text: enough for a 2048-token BPE and two ranks' windows."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
    with path.open("w") as f:
        for i in range(400):
            line = " ".join(words[(i * 7 + j) % len(words)] for j in range(40))
            f.write(json.dumps({"text": f"{i}: {line}."}) + "\n")


def _written(argv: list[str], out: str) -> str | None:
    """What a command wrote that a later one must not write again: a run directory (from
    train's closing line), prepare's ``--out``, plan's ``--emit-toml``."""
    if argv[:2] == ["shardwise", "train"]:
        m = re.search(r"outputs in (\S+)", out)
        return str(Path(m.group(1))) if m else "no closing line"
    for flag in ("--out", "--emit-toml"):
        if argv[1:2] in (["prepare"], ["plan"]) and flag in argv:
            return str(Path(argv[argv.index(flag) + 1]))
    return None


def _in_process(argv: list[str], capfd) -> tuple[int, str]:
    """``argv`` (``shardwise ...``) through the CLI's entry point in this process (cwd: the
    copy), its output and its ranks' read from the file descriptors."""
    from shardwise.cli.main import main

    capfd.readouterr()
    try:
        code = main(argv[1:])
    except SystemExit as e:  # argparse's usage errors
        code = e.code if isinstance(e.code, int) else 1
    got = capfd.readouterr()
    return code, got.out + got.err


@pytest.mark.skipif(not (REPO / ".git").exists() or shutil.which("git") is None,
                    reason="needs a git checkout (the fresh copy is git ls-files)")
@pytest.mark.parametrize("full", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["in-process", "full"])
def test_the_readme_runs_in_order(tmp_path, monkeypatch, capfd, full):
    """Every shell command of the README but SKIPPED's, in order, on a fresh copy of the
    repository: each exits 0; no training run resumes one; no two write the same run
    directory, shards or config; all failures are reported. In ``make test`` each command
    runs through ``shardwise.cli.main.main`` in this process (no interpreter and fork
    server started per command: ~10 s of CPU each) and SLOW_ONLY's are left out; the slow
    set runs each one as its own process, ``shardwise`` on PATH, as a reader types them."""
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    _fresh_copy(repo)
    _shim(bin_dir, repo / "src")
    _corpus(repo / CORPUS)
    monkeypatch.chdir(repo)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    written: dict[str, str] = {}  # what a command wrote -> that command
    ran, skipped, timings, problems = 0, [], [], []
    for line in readme_commands((repo / "README.md").read_text(encoding="utf-8")):
        argv = shlex.split(line, comments=True)
        why = _first_words(argv, SKIPPED) or (None if full else _first_words(argv, SLOW_ONLY))
        if why:
            skipped.append(f"{line[:60]}: {why}")
            continue
        argv = shrunk(argv)
        t0 = time.perf_counter()
        if full or argv[0] != "shardwise":
            p = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True,
                               timeout=600, check=False)
            code, out = p.returncode, p.stdout + p.stderr
        else:
            code, out = _in_process(argv, capfd)
        timings.append(f"{time.perf_counter() - t0:6.1f} s  {line[:90]}")
        if code != 0:
            problems.append(f"{line}\nexit {code}\n{out[-2000:]}")
            continue
        ran += 1
        where = _written(argv, out)
        if where in written:
            problems.append(f"{line}\nwrites {where}, as `{written[where]}` did")
        elif re.search(r"\bresum(ed|ing)\b", out):
            problems.append(f"{line}\nresumed a run\n{out[-2000:]}")
        elif where is not None:
            written[where] = line
    assert not problems, "\n\n".join(problems + ["", *timings, "skipped:", *skipped])
    assert ran >= 8 and len(written) >= 8, written
