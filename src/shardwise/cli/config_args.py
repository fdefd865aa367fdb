"""``--section.field VALUE`` for every config field: the ``shardwise train`` options and their
help, generated from the pydantic models of ``shardwise.base.config`` (``config_fields``),
so a field's type, default and description are written once, where the field is.

The options only collect the raw text: ``overrides(args)`` gives it back as
``["--section.field", "VALUE", ...]`` for ``Config.load`` to parse as TOML literals and
validate, so a value is checked (and its error worded) the same way from the command line
and from a TOML file. A key that is not a field never matches an option; it reaches
``Config.load``, which names it and suggests the nearest field.
"""

from __future__ import annotations

import argparse

DEST = "config_overrides"


class _Override(argparse.Action):
    """Append ``(section.field, raw text)`` to ``namespace.config_overrides``."""

    def __call__(self, parser, namespace, values, option_string=None):
        got = list(getattr(namespace, DEST, None) or [])
        got.append((self.metavar_key, values))
        setattr(namespace, DEST, got)


def format_default(value) -> str:
    """A default as it would be written in TOML (``true``, ``[32, 64]``, ``0.003``);
    None (no TOML spelling) is ``unset``."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return format(value, "g")
    if isinstance(value, list):
        return "[" + ", ".join(format_default(v) if not isinstance(v, str) else f'"{v}"'
                               for v in value) + "]"
    return str(value)


def add_config_arguments(parser: argparse.ArgumentParser, kind: str | None = None,
                         module: str | None = None) -> None:
    """One argument group per config section, one ``--section.field TYPE`` option per field
    help: description (default: X; bounds). The ``[model]`` group lists the fields every
    kind shares and those of ``kind`` (``--model.kind`` on the command line; None: the GPT,
    the default kind), after importing ``module`` (``--model.module``: it may register the
    kind; an error there is left for the run to report); the other kinds' fields are
    options too, without help."""
    from shardwise.base.config import config_fields, config_sections, model_kind_fields
    from shardwise.base.model_config import import_model_module

    try:
        import_model_module(module or "")
    except ValueError:
        pass  # the run names it, in one line (Config.load)

    parser.set_defaults(**{DEST: []})
    fields = config_fields()
    shown = model_kind_fields(kind or "gpt")
    names = {f.name for f in fields if f.section == "model"} | {f.name for f in shown}
    # an unregistered kind's fields: ModelConfig's, every decoder field of shardwise's kinds
    hidden = [f for f in model_kind_fields("") if f.name not in names]
    for section, summary in config_sections():
        group = parser.add_argument_group(f"[{section}]", summary.replace("``", "").replace("%", "%%"))
        own = [f for f in fields if f.section == section]
        if section == "model":
            own += shown
            for f in hidden:
                action = group.add_argument(f"--{f.key}", action=_Override, metavar=f.type,
                                            dest=argparse.SUPPRESS, help=argparse.SUPPRESS)
                action.metavar_key = f.key
        for f in own:
            extra = f"; {f.bounds}" if f.bounds else ""
            text = f"{f.description or f.name} (default: {format_default(f.default)}{extra})"
            action = group.add_argument(f"--{f.key}", action=_Override, metavar=f.type,
                                        dest=argparse.SUPPRESS, help=text.replace("%", "%%"))
            action.metavar_key = f.key


def model_option(argv: list[str], name: str) -> str | None:
    """The value of ``--model.NAME`` (or ``--model.NAME=X``) in ``argv``, the last one
    given; None without one (``--model.kind``: the kind whose fields ``--help`` lists)."""
    flag, value = f"--model.{name}", None
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif tok.startswith(flag + "="):
            value = tok.partition("=")[2]
    return value.strip('"') if value else None


def overrides(args: argparse.Namespace) -> list[str]:
    """The config options given, back as ``["--section.field", "VALUE", ...]`` in order."""
    return [tok for key, value in getattr(args, DEST, None) or [] for tok in (f"--{key}", value)]


def reference() -> str:
    """Every config field as Markdown: one table per section (field, TOML type, default,
    bounds, meaning), from the same ``config_fields`` as ``--help``. ``docs/config.md`` is
    this text (``python -m shardwise.cli.config_args > docs/config.md``; a test compares)."""
    from shardwise.base.config import config_fields, config_sections, model_kind_fields
    from shardwise.base.model_config import section_class

    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    fields = config_fields()
    lines = ["# Configuration reference", "",
             "Every field of a run's TOML file, by section, as `shardwise train --help` lists "
             "them. Set a field in the file (`[parallel]` then `tp = 2`) or on the command "
             "line (`--parallel.tp 2`, the value a TOML literal). Generated from "
             "`src/shardwise/base/config.py` by `python -m shardwise.cli.config_args > "
             "docs/config.md`; `tests/test_cli.py` fails when this page falls behind.", ""]

    def table(rows) -> list[str]:
        out = ["| field | type | default | meaning |", "|---|---|---|---|"]
        for f in rows:
            bounds = f"; {f.bounds}" if f.bounds else ""
            default = '""' if f.default == "" else cell(format_default(f.default))
            out.append(f"| `{f.name}` | {cell(f.type)} | `{default}`{cell(bounds)} | "
                       f"{cell(f.description.replace('``', '`'))} |")
        return [*out, ""]

    for section, summary in config_sections():
        lines += [f"## [{section}]", "", cell(summary.replace("``", "`")), "",
                  *table(f for f in fields if f.section == section)]
        if section == "model":
            for kind in ("gpt", "llama"):
                doc = section_class(kind).__doc__ or ""
                lines += [f"### [model] with kind = \"{kind}\"", "",
                          cell(" ".join(doc.split()).replace("``", "`")), "",
                          *table(model_kind_fields(kind))]
    return "\n".join(lines + REFUSED)


# docs/config.md's last section (it was the README's): what stops a run at the door. The rules
# themselves are checked in base/config.py and the applications' check_config; keep in step.
REFUSED = [
    "## Refused at the door", "",
    "Unknown keys, wrong types and impossible combinations stop the run before any rank "
    "starts, with one line naming the field and exit code 2; a misspelt key gets a suggestion "
    "(`--optimizer.lrr 1e-3`: `optimizer.lrr: unknown key; did you mean optimizer.lr?`). "
    "Among the combinations refused in one line:", "",
    "- ZeRO-3 with more than one chunk per rank at pp = 1 with tied embeddings (one parameter "
    "in two chunks). ZeRO-3 composes with every flush schedule otherwise, interleaved included "
    "(each chunk a ZeRO-3 module of its own: `--parallel.pp 2 --parallel.schedule interleaved "
    "--parallel.chunks_per_rank 2 --parallel.zero 3`);",
    "- PipeDream with ZeRO, fp16, or clipping on (it needs `--optimizer.grad_clip 0`), and "
    "PipeDream with the embedding tied to the head across stages;",
    "- `training.compile` with tp > 1 and dropout;",
    "- `training.global_batch_size` not divisible by dp × `parallel.micro_batches`;",
    "- the interleaved schedule with more than one chunk per rank and m "
    "(`parallel.micro_batches`) not a multiple of pp; dualpipev with m < 2 pp; more than "
    "one chunk per rank under another schedule (zbv and dualpipev: exactly two);",
    "- `training.precision = \"fp8\"` off CUDA of compute capability 8.9 or more, or with "
    "tp > 1 ([fp8.md](fp8.md));",
    "- `parallel.recompute = \"selective\"` or `\"full\"` with PipeDream, `\"selective\"` "
    "on CUDA (until its GPU test "
    "has run, [gpu.md](gpu.md#one-gpu-speed));",
    "- `parallel.sequence_parallel` with `model.block_size / cp` not divisible by tp; "
    "`parallel.cp` with `model.block_size` not divisible by 2 cp; `parallel.ep` that does not "
    "divide dp, or with no experts;",
    "- `lora.rank` > 0 with `lora.targets` matching no linear layer of the blocks (or the "
    "embedding or head) or matching a mixture's expert weights, with fp8, or PipeDream "
    "([lora.md](lora.md)).",
    "",
    "A Hugging Face checkpoint's refusals (a `[model]` field other than its `config.json`'s, "
    "another architecture, ...) are in "
    "[models.md](models.md#start-from-a-hugging-face-checkpoint); examples of the one-line "
    "errors in [reliability.md](reliability.md#bad-input-stops-before-any-rank-starts).", ""]


if __name__ == "__main__":
    print(reference(), end="")
