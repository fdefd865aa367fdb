"""The command line: bad input gives one line and exit code 2; a real run and a resume
(by default: a second run into the same out_dir continues from its checkpoint)."""

import pytest

from helpers import assert_one_line_exit_2, assert_proc_one_line_exit_2, run_shardwise
from shardwise.cli.main import main


@pytest.mark.parametrize("argv, expected", [
    (["--parallel.dpp", "2"], "parallel.dpp: unknown key"),
    (["--parallel.dp", "two"], "parallel.dp: Input should be a valid integer"),
    (["--parallel.dp", "0"], "parallel.dp: Input should be greater than or equal to 1"),
    # inf / nan are TOML literals too: an infinite rate or timeout failed inside the ranks
    (["--optimizer.lr", "inf"], "optimizer.lr: Input should be a finite number (got inf)"),
    (["--parallel.timeout_s", "inf"], "parallel.timeout_s: Input should be a finite number"),
    (["--optimizer.grad_clip", "nan"], "optimizer.grad_clip: Input should be a finite number"),
    (["--training.global_batch_size", "30", "--parallel.dp", "4"],
     "training.global_batch_size=30 must be divisible by parallel.dp x parallel.micro_batches"),
    (["--model.n_head", "3"], "model.n_embd=128 must be divisible by model.n_head=3"),
    (["--parallel.allreduce", "carrier-pigeon"], "parallel.allreduce='carrier-pigeon'"),
    (["--data", "/no/such/file.txt"], "data.path: file '/no/such/file.txt' not found"),
    (["--config", "/no/such.toml"], "config file '/no/such.toml' not found"),
    (["--resume", "--checkpoint.dir", "/tmp/shardwise-none"], "--resume: no complete checkpoint"),
    (["--bogus"], "unrecognised argument '--bogus'"),
    (["--parallel.schedule", "zigzag"], "error: parallel.schedule='zigzag': expected"),
    (["--parallel.schedule", "foo"],  # a choice field: its registry's names, in one line
     "parallel.schedule='foo': expected naive, gpipe, 1f1b, interleaved, pipedream, zb1p, zbv "
     "or dualpipev"),
    (["--parallel.pp", "2", "--parallel.micro_batches", "2", "--parallel.schedule", "dualpipev",
      "--parallel.chunks_per_rank", "2"],
     "parallel.micro_batches=2 must be at least 2 x parallel.pp = 4 for the dualpipev schedule"),
    (["--parallel.pp", "2", "--parallel.micro_batches", "2", "--parallel.schedule", "zb1p",
      "--parallel.zero", "3"], "parallel.schedule=zb1p with parallel.zero=3: ZeRO-3 frees"),
    (["--parallel.pp", "2", "--parallel.micro_batches", "2", "--parallel.schedule", "zbv"],
     "parallel.schedule=zbv places two chunks per rank in a V: set parallel.chunks_per_rank"),
    (["--parallel.zero", "4"], "parallel.zero=4: expected 0, 1, 2 or 3"),
    (["--parallel.zero", "true"], "parallel.zero=True: expected 0, 1, 2 or 3"),
    (["--training.wandb", "yes"], "training.wandb='yes': expected offline, online or empty"),
    (["--model.kind", "cnn", "--parallel.zero", "1"],  # the CNN's AppSpec, at the door
     "model.kind=cnn trains in fp32 on its own group (cnn.ranks)"),
    (["--model.kind", "cnn", "--model.init_from", "hf:x"], "model.init_from with model.kind=cnn"),
    (["--model.kind", "llama", "--model.sliding_window", "-1"],
     "model.sliding_window: Input should be greater than or equal to 0"),
    (["--model.sliding_window", "8"], "model.sliding_window=8: the GPT has no such option"),
    (["--model.kind", "llama", "--model.n_layer", "2", "--model.sliding_window", "8",
      "--model.layer_types", '["sliding_attention", "full"]'],
     ("model.layer_types: expected 2 (model.n_layer) of full_attention or "
      "sliding_attention; got 'full'")),
    (["--model.kind", "llama", "--model.n_layer", "1", "--model.layer_types",
      '["sliding_attention"]'],
     ("model.layer_types has sliding_attention layers but model.sliding_window is not "
      "set")),
])
def test_bad_input_is_one_line_and_exit_2(argv, expected, capsys):
    assert_one_line_exit_2(["train", *argv], capsys, expected)


def test_choice_fields_are_their_registries_names():
    """A choice field is a Literal of the names the module that implements it runs."""
    from typing import get_args

    from shardwise.apps.param_server.clock import CONSISTENCIES
    from shardwise.base.config import Config, config_fields
    from shardwise.comm import ALL_TO_ALL_ALGORITHMS, ALLREDUCE_ALGORITHMS
    from shardwise.parallel.float8 import RECIPES
    from shardwise.parallel.pipeline.schedules import KINDS
    from shardwise.parallel.precision import DTYPES

    names = {"parallel.schedule": KINDS, "parallel.allreduce": ALLREDUCE_ALGORITHMS,
             "parallel.all_to_all": ALL_TO_ALL_ALGORITHMS, "training.precision": tuple(DTYPES),
             "training.fp8_recipe": RECIPES, "ps.consistency": CONSISTENCIES,
             "parallel.zero": (0, 1, 2, 3), "training.device": ("auto", "cpu", "cuda")}
    for key, want in names.items():
        section, field = key.split(".")
        annotation = Config.model_fields[section].annotation.model_fields[field].annotation
        assert get_args(annotation) == tuple(want), key
    bounds = {f.key: f.bounds for f in config_fields()}  # what --help and docs/config.md show
    assert bounds["parallel.schedule"] == "one of " + ", ".join(KINDS)


def test_applications_check_their_own_sections():
    """``Config`` holds only the rules every application shares: the CNN's and the parameter
    server's are their ``AppSpec.check_config``'s, run at the door, and the rank grid's rules
    do not reach a run the grid does not place."""
    from shardwise.apps.registry import app_for
    from shardwise.base.config import Config, ConfigError

    cases = {"parallel.cp=2 with model.kind=cnn": {"model": {"kind": "cnn"}, "parallel": {"cp": 2}},
             "model.kind=cnn trains in fp32": {"model": {"kind": "cnn"}, "parallel": {"zero": 1}},
             "parallel.tp=2 with parallel.mode=ps": {"parallel": {"mode": "ps", "tp": 2}},
             "parallel.mode=ps trains in fp32 without ZeRO": {"parallel": {"mode": "ps",
                                                                          "zero": 2}}}
    for message, data in cases.items():
        cfg = Config.from_dict(data)
        with pytest.raises(ConfigError, match=message):
            app_for(cfg).check_config(cfg)
    # the parameter server has no pipeline: its [parallel].schedule is not read
    Config.from_dict({"parallel": {"mode": "ps", "schedule": "pipedream"}})


def test_bad_config_file_values(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = 'many'\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "training.steps: Input should be a valid integer" in capsys.readouterr().err
    bad.write_text("[training\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "is not valid TOML" in capsys.readouterr().err


def test_entry_point_exit_code_for_bad_input():
    assert_proc_one_line_exit_2(run_shardwise("train", "--parallel.dp", "0"))


def test_train_then_resume_end_to_end(corpus, tmp_path):
    out = tmp_path / "run"
    common = ["train", "--config", "configs/tiny.toml", "--data", str(corpus),
              "--training.out_dir", str(out)]
    first = run_shardwise(*common)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "validation loss" in first.stdout and "sample:" in first.stdout
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "checkpoints" / "step_000006").is_dir()
    second = run_shardwise(*common, "--training.steps", "8")  # resuming is the default
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "at step 6" in second.stdout
    assert "done: 8 steps" in second.stdout
    from shardwise.training.metrics import read_metrics

    train = [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert train == list(range(1, 9))  # continued from the resumed step, no row twice


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own errors
        return e.code


def test_bad_input_that_used_to_escape_the_early_checks(corpus, tmp_path, capsys):
    """Each case: one line, exit 2, and no rank started (nothing written to out_dir)."""
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    base = ["train", "--config", "configs/tiny.toml", "--data", str(corpus)]
    cases = [
        (["train", "--config", "configs/tiny.toml", "--data", str(short),
          "--training.out_dir", str(tmp_path / "r1")],
         "data.path: " + str(short) + " holds 19 characters: 0 training windows"),
        (base + ["--training.out_dir", str(a_file / "run")],
         f"training.out_dir: cannot write to {str(a_file / 'run')!r} (Not a directory)"),
        (base + ["--training.out_dir", "/sys/shardwise-run"],
         "training.out_dir: cannot write to '/sys/shardwise-run'"),
        (base + ["--training.out_dir", str(tmp_path / "r2"), "--checkpoint.dir",
                 str(a_file / "ck")], "checkpoint.dir: cannot write to"),
        (base + ["--resume", "--fresh"], "--resume and --fresh exclude each other"),
        (base + ["--max-restarts", "-1"], "argument --max-restarts: expected a whole number >= 0"),
    ]
    for argv, expected in cases:
        assert_one_line_exit_2(argv, capsys, expected, main=_exit_code)
    assert not (tmp_path / "r1" / "metrics.jsonl").exists()


def test_a_refused_resume_leaves_no_directory_or_lock_behind(corpus, tmp_path, capsys):
    """--resume with nothing to resume used to leave training.out_dir, checkpoint.dir and
    the lock file created; a new directory is gone again, an existing one as it was."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (tmp_path / "new" / "run", empty):
        assert_one_line_exit_2(["train", "--config", "configs/tiny.toml", "--data", str(corpus),
                                "--training.out_dir", str(out), "--resume"], capsys,
                               "--resume: no complete checkpoint")
    assert not (tmp_path / "new").exists()
    assert list(empty.iterdir()) == []


def test_bad_numbers_in_generate_and_prepare_are_one_line(tmp_path, capsys):
    """The shared argparse types (``cli.common.whole_number``, ``positive_number``): one
    line naming the argument, exit 2, before anything is read."""
    run = str(tmp_path / "no-run")
    cases = [
        (["generate", run, "--tokens", "0"], "argument --tokens: expected a whole number >= 1"),
        (["generate", run, "--top-k", "-3"], "argument --top-k: expected a whole number >= 0"),
        (["generate", run, "--temperature", "nan"],
         "argument --temperature: expected a number > 0, got 'nan'"),
        (["prepare", run, "--vocab-size", "0"],
         "argument --vocab-size: expected a whole number >= 1"),
    ]
    for argv, expected in cases:
        assert_one_line_exit_2(argv, capsys, expected, main=_exit_code)


def test_resume_below_the_checkpoint_step_is_refused(corpus, tmp_path, capsys):
    from ddp_workers import tiny_config
    from fault_workers import train_saving

    out = tmp_path / "run"
    train_saving(tiny_config(str(corpus), str(out), training={"steps": 4,
                                                               "global_batch_size": 8}), at=(4,))
    argv = ["train", "--config", "configs/tiny.toml", "--data", str(corpus),
            "--training.out_dir", str(out), "--training.steps", "3"]
    for extra in ([], ["--resume"]):
        assert_one_line_exit_2(argv + extra, capsys,
                               "training.steps=3 is below step 4 of the checkpoint")
    assert main(argv + ["--model.n_embd", "64"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "model.n_embd=32 there, 64 here" in err


@pytest.mark.parametrize("argv, expected", [
    (["--params", "inf"], "--params inf: expected a finite number >= 1"),
    (["--params", "nan"], "--params nan: expected a finite number >= 1"),
    (["--params", "1e6", "--budget-mb", "-3"], "--budget-mb -3: expected a finite number > 0"),
    (["--params", "lots"], "argument --params: invalid float value: 'lots'"),
])
def test_memory_bad_numbers(argv, expected, capsys):
    assert_one_line_exit_2(["memory", *argv], capsys, expected, main=_exit_code)


# ---- help, suggestions, --version (issue 20) ----------------------------------------------
def _help(argv, capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at the terminal's width
    code = _exit_code(argv)
    out = capsys.readouterr().out
    return code, " ".join(out.split())


def test_train_help_lists_every_config_field(capsys, monkeypatch):
    from shardwise.base.config import Config

    code, text = _help(["train", "--help"], capsys, monkeypatch)
    assert code == 0
    assert ("--optimizer.weight_decay float decoupled weight decay (AdamW" in text
            and "(default: 0.1; >= 0.0)" in text)
    assert ("--parallel.sequence_parallel bool with tp > 1: shard LayerNorm/dropout regions "
            "along the sequence" in text)
    for real in ("--config", "--data", "--resume", "--fresh", "--max-restarts"):
        assert real in text
    n = 0
    for section, sinfo in Config.model_fields.items():  # walk the pydantic models
        assert f"[{section}]" in text
        for name, info in sinfo.annotation.model_fields.items():
            assert info.description, f"{section}.{name} has no description"
            assert f"--{section}.{name} " in text, f"{section}.{name}"
            assert " ".join(info.description.split()).replace("%", "") in text.replace("%", "")
            n += 1
    assert n > 60 and text.count("(default: ") >= n



def test_the_configuration_reference_page_is_current():
    """docs/config.md is the generated reference of every field (so it cannot fall behind
    config.py); regenerate it with ``python -m shardwise.cli.config_args > docs/config.md``."""
    from helpers import REPO
    from shardwise.base.config import config_fields
    from shardwise.cli.config_args import reference

    page = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    assert page == reference(), ("docs/config.md is stale: run python -m "
                                 "shardwise.cli.config_args > docs/config.md")
    for f in config_fields():
        assert f"| `{f.name}` |" in page
    assert "Undefined" not in page, "a default_factory's default shown as pydantic's marker"


def test_relative_links_in_the_readme_and_docs_reach_a_file_and_heading():
    """Every relative Markdown link of README.md and docs/*.md names a file that exists and,
    with ``#anchor``, a heading of that file (GitHub's anchors: lower case, punctuation but
    hyphens and underscores dropped, spaces to hyphens)."""
    import re

    from helpers import REPO

    def anchors(path):
        out = set()
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("#"):
                title = line.lstrip("#").strip().lower()
                out.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", title)))
        return out

    bad = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{page.name}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("argv, expected", [
    (["--optimizer.lrr", "1e-3"], "shardwise: error: optimizer.lrr: unknown key; did you mean optimizer.lr?"),
    (["--optimiser.lr", "1e-3"], "shardwise: error: optimiser: unknown section; did you mean optimizer?"),
    (["--training.lr", "1e-3"], "training.lr: unknown key; did you mean optimizer.lr?"),
    (["--parallel.dpp", "2"], "parallel.dpp: unknown key; did you mean parallel.dp?"),
    (["--parallel.zzz", "2"], "parallel.zzz: unknown key; expected one of dp, pp, tp,"),
    (["--optimizer.lr"], "argument --optimizer.lr: expected one argument"),
])
def test_unknown_keys_get_a_suggestion(argv, expected, capsys):
    assert _exit_code(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and expected in err, err


def test_config_file_keys_get_a_suggestion(tmp_path, capsys):
    bad = tmp_path / "typo.toml"
    bad.write_text("[optimizer]\nweight_decai = 0.1\n")
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err == ("shardwise: error: optimizer.weight_decai: unknown key; did you mean "
                   "optimizer.weight_decay?\n")


def test_overrides_given_as_options_reach_the_config(monkeypatch):
    """The generated options hand their text to cmd_train, in order, as before."""
    import importlib

    cli_main = importlib.import_module("shardwise.cli.main")  # the package exports main()
    seen = {}
    monkeypatch.setattr(cli_main, "cmd_train", lambda args, extra: seen.setdefault("x", extra) and 0)
    parser_args = ["train", "--optimizer.lr", "1e-3", "--parallel.micro_batches=4",
                   "--model.bias", "false", "--optimizer.lr", "2e-3"]
    assert cli_main.main(parser_args) == 0
    assert seen["x"] == ["--optimizer.lr", "1e-3", "--parallel.micro_batches", "4",
                         "--model.bias", "false", "--optimizer.lr", "2e-3"]
    assert cli_main.split_overrides(seen["x"]) == {"optimizer.lr": 2e-3,
                                                    "parallel.micro_batches": 4,
                                                    "model.bias": False}


def test_version(capsys):
    from shardwise.base.version import version

    assert _exit_code(["--version"]) == 0
    out = capsys.readouterr().out
    assert out == f"shardwise {version()}\n" and version().count(".") >= 2


@pytest.mark.parametrize("argv", [
    ["--help"], ["train", "--help"], ["bench", "--help"], ["bench", "comm", "--help"],
    ["bench", "calibrate", "--help"],
    ["memory", "--help"], ["plan", "--help"], ["plan", "--model", "cnn", "--help"],
    ["timeline", "--help"], ["prepare", "--help"], ["export", "--help"], ["generate", "--help"],
])
def test_every_help_exits_0(argv, capsys, monkeypatch):
    code, text = _help(argv, capsys, monkeypatch)
    assert code == 0 and text.startswith("usage: shardwise"), text[:200]
    assert "``" not in text, "reST markup of a docstring in --help"  # plain text on a terminal
