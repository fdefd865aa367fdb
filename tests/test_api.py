"""The front door: ``import shardwise`` exports the public API, lazily; and ``shardwise plan``
for a named size imports neither the engine nor ``torch._dynamo`` (about a second each)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import shardwise

SRC = Path(__file__).resolve().parents[1] / "src"


def _fresh(code: str) -> str:
    """Run ``code`` in a new interpreter (nothing imported yet) and return its stdout."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("name", [n for n in shardwise.__all__])
def test_every_exported_name_resolves(name):
    assert getattr(shardwise, name) is not None


def test_dir_lists_the_public_api():
    assert set(shardwise.__all__) <= set(dir(shardwise))
    assert len(shardwise.__all__) == len(set(shardwise.__all__))


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'TPGPT'"):
        shardwise.TPGPT  # noqa: B018 (being removed: not part of the public API)


def test_exports_are_the_implementations():
    from shardwise.launch import spawn
    from shardwise.parallel.pipeline import check
    from shardwise.parallel.tensor_parallel import ColumnParallelLinear

    assert shardwise.spawn is spawn and shardwise.launch.spawn is spawn
    assert shardwise.check_schedule is check
    assert shardwise.ColumnParallelLinear is ColumnParallelLinear
    assert shardwise.comm.all_reduce is sys.modules["shardwise.comm"].all_reduce


def test_version():
    assert isinstance(shardwise.__version__, str) and shardwise.__version__[0].isdigit()
    text = (SRC.parent / "pyproject.toml").read_text()
    assert f'version = "{shardwise.__version__}"' in text


def test_import_is_lazy():
    """``import shardwise`` loads no subpackage and not torch; a name loads its module only."""
    out = _fresh("import shardwise, sys; "
                 "print(sorted(m for m in sys.modules if m.startswith(('shardwise.', 'torch'))))")
    assert out == "[]"
    out = _fresh("import shardwise, sys; shardwise.Topology; "
                 "print('shardwise.base.topology' in sys.modules, 'shardwise.engine' in sys.modules,"
                 " 'torch.distributed' in sys.modules)")
    assert out == "True False False"


def test_plan_of_a_named_size_imports_no_engine_and_no_dynamo():
    """``shardwise plan --model llama3-8b`` (and mixtral-8x7b, whose experts are the MoE's)
    runs in process without importing the engine, a model (``models.llama`` -> ``models.moe``)
    or ``torch._dynamo``: ``planner.memory`` imports ``engine.memory.predict_rank`` only on
    its exact path, and ``shardwise.models`` loads its models lazily (``@torch.compiler.disable``
    at module level, in the MoE and in tensor_parallel, imports dynamo)."""
    heavy = ("torch._dynamo", "shardwise.engine", "shardwise.models.gpt",
             "shardwise.models.llama", "shardwise.models.moe")
    out = _fresh(
        "import contextlib, io, sys\n"
        "import shardwise.cli.plan\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
        "from shardwise.cli.main import main\n"
        "for argv in (['--model', 'llama3-8b', '--gpus', '8', '--global-batch', '64'],\n"
        "             ['--model', 'mixtral-8x7b', '--gpus', '16', '--global-batch', '16']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        assert main(['plan', '--cluster', 'dgx-a100-80gb', *argv]) == 0\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    assert out == "[]\n[]"


def test_plan_of_a_named_model_on_a_preset_imports_no_torch():
    """``import shardwise.planner`` and ``shardwise plan --model megatron-1t --cluster
    dgx-a100-80gb`` (here llama3-8b, the same path in a fraction of the time) import no torch:
    ``comm``, ``perf`` and ``parallel.pipeline`` load their submodules lazily, the GPU table
    is ``perf.gpus``, and the ``local`` cluster's calibration imports torch only when it runs
    (torch was two of the plan's ~8 s of CPU on two cores)."""
    out = _fresh(
        "import contextlib, io, sys\n"
        "import shardwise.planner, shardwise.planner.search\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
        "from shardwise.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['plan', '--model', 'llama3-8b', '--cluster', 'dgx-a100-80gb',\n"
        "                 '--gpus', '8', '--global-batch', '64']) == 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    assert out == "[]\n[]"


def test_config_errors_and_help_are_answered_without_importing_torch(tmp_path):
    """The door of ``shardwise``: a misspelt key in a TOML, a wrong type, an unknown option,
    a misspelt model kind (its "did you mean"), ``--help``, ``--version`` and the helps of
    ``train``, ``memory`` and ``plan`` are answered (exit 2, or 0 for the helps) before torch
    is imported: torch takes seconds to import, a typo should take none."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nstepz = 3\n")
    cases = [["--help"], ["--version"], ["train", "--help"], ["memory", "--help"],
             ["plan", "--help"], ["train", "--config", str(bad)],
             ["train", "--training.steps", "abc"], ["train", "--parallel.dpp", "2"],
             ["train", "--bogus", "1"], ["train", "--model.kind", "gtp"]]
    out = _fresh(
        "import contextlib, io, sys\n"
        "from shardwise.cli.main import main\n"
        f"for argv in {cases!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), "
        "contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n"
        "            code = main(argv)\n"
        "        except SystemExit as e:\n"
        "            code = e.code\n"
        "    print(' '.join(argv[:2]), code, 'torch' in sys.modules)")
    got = [line.rsplit(" ", 2)[1:] for line in out.splitlines()]
    assert got == [["0", "False"]] * 5 + [["2", "False"]] * 5, out
    # the kind's line is the registry's own, with its guess, before any model is imported
    kind = _fresh("import contextlib, io\n"
                  "from shardwise.cli.main import main\n"
                  "err = io.StringIO()\n"
                  "with contextlib.redirect_stderr(err):\n"
                  "    main(['train', '--model.kind', 'gtp'])\n"
                  "print(err.getvalue().strip())")
    assert kind.startswith("shardwise: error: model.kind='gtp': not a registered model (gpt, "
                           "llama, cnn); did you mean 'gpt', or set model.module"), kind


def test_docs_api_covers_every_name():
    """``docs/api.md`` documents each exported name (so the page cannot fall behind)."""
    text = (SRC.parent / "docs" / "api.md").read_text()
    missing = [n for n in shardwise.__all__ if f"`{n}" not in text and f".{n}`" not in text]
    assert not missing, f"names exported but not in docs/api.md: {missing}"


def test_docs_api_names_resolve_and_signatures_match():
    """The converse: every name a table of ``docs/api.md`` gives as ``shardwise.NAME`` is
    exported, and where a row shows ``NAME(arg, ...)`` each argument is a parameter of that
    name (a keyword a reader copies works) and each parameter is shown or named in the row
    (``(also `names`: for the engine)``, ``moe_*``)."""
    import inspect
    import re

    text = (SRC.parent / "docs" / "api.md").read_text()
    rows = re.findall(r"^\| `([A-Za-z_]\w*)`(?:, `([A-Za-z_]\w*)`)* \| (.*)$", text, re.M)
    names = {n for line in re.findall(r"^\| (`[A-Za-z_][^|]*)\|", text, re.M)
             for n in re.findall(r"`([A-Za-z_]\w*)`", line)}
    assert not sorted(names - set(shardwise.__all__)), "docs/api.md names not exported"
    bad = []
    for name, _, rest in rows:
        call = re.match(rf"`{name}\((.*?)\)(?: ->[^`]*)?`", rest)
        obj = getattr(shardwise, name)
        if not call or not callable(obj):
            continue
        args = call.group(1)
        inner = re.fullmatch(r"(\w+)\((.*)\)", args)
        if inner:  # GPT(GPTConfig(...)): the config's fields
            name, args = inner.groups()
            obj = getattr(shardwise, name)
        shown = [a.split("=")[0].split(":")[0].strip() for a in
                 re.split(r",(?![^()\[\]{}]*[)\]}])", args)
                 if a.strip() not in ("", "*", "...")]
        params = [p for p in inspect.signature(obj).parameters]
        unshown = [p for p in params if p not in shown and not re.search(
            rf"`{p}[`=]", rest) and not any(p.startswith(w[:-1]) for w in
                                             re.findall(r"`(\w+\*)`", rest))]
        bad += [f"{name}: {a} not a parameter" for a in shown if a not in params]
        bad += [f"{name}: {p} not shown" for p in unshown]
    assert not bad, bad
