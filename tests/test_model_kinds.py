"""Each model kind's ``[model]`` section is its own class (``base.model_config``): a field is
declared once, with its description, and reaches ``--help``, the model the trainer builds and
the planner's spec with no other edit (issue 39)."""

from __future__ import annotations

import pytest
import torch.nn as nn
from pydantic import Field

from shardwise.base.config import Config, ConfigError, config_fields, model_kind_fields
from shardwise.base.model_config import GPTModelConfig, LlamaModelConfig, ModelSection
from shardwise.models import describe_section, register_model
from shardwise.models.description import ModelDescription


class ToySection(ModelSection):
    """A toy decoder: an MLP of ``width_factor`` x n_embd per block, no attention."""

    # the one new option: declared here, nowhere else
    width_factor: int = Field(3, ge=1, description="each block's MLP width over n_embd")


class _Block(nn.Module):
    def __init__(self, c: ToySection):
        super().__init__()
        self.fc = nn.Linear(c.n_embd, c.width_factor * c.n_embd, bias=False)
        self.proj = nn.Linear(c.width_factor * c.n_embd, c.n_embd, bias=False)

    def forward(self, x):
        return x + self.proj(self.fc(x).relu())


class _Embed(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.tok = nn.Embedding(c.vocab_size, c.n_embd)

    def forward(self, idx):
        return self.tok(idx)


class _Head(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.proj = nn.Linear(c.n_embd, c.vocab_size, bias=False)

    def forward(self, x):
        return self.proj(x)


class Toy(nn.Module):
    def __init__(self, c: ToySection):
        super().__init__()
        self.embed = _Embed(c)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layer))
        self.head = _Head(c)


def _describe(c: ToySection) -> ModelDescription:
    return ModelDescription(
        kind="toy_kind", config=c, build=lambda: Toy(c),
        tp_plan={"embed.tok": "vocab_embedding", "blocks.*.fc": "column",
                 "blocks.*.proj": "row", "head.proj": "vocab_head"},
        hidden_size=c.n_embd, vocab_size=c.vocab_size, block_size=c.block_size,
        n_layer=c.n_layer, attention_width=0,
        tp_divides={"MLP width model.width_factor x model.n_embd": c.width_factor * c.n_embd})


register_model("toy_kind", ToySection, _describe)  # the section is the config: no from_section


def test_a_new_option_of_a_kind_reaches_help_the_model_and_the_planner(capsys, monkeypatch):
    from shardwise.cli.main import main
    from shardwise.planner.specs import ModelSpec

    doc = next(f for f in model_kind_fields("toy_kind") if f.name == "width_factor")
    assert (doc.key, doc.type, doc.default, doc.bounds) == ("model.width_factor", "int", 3, ">= 1")
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        main(["train", "--help", "--model.kind", "toy_kind"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--model.width_factor int each block's MLP width over n_embd (default: 3; >= 1)" in text
    assert "--model.n_kv_heads" not in text  # the Llama's, not this kind's

    cfg = Config.from_dict({"model": {"kind": "toy_kind", "n_layer": 2, "n_embd": 8,
                                      "width_factor": 5}})
    assert isinstance(cfg.model, ToySection) and cfg.model.width_factor == 5
    assert Config.from_dict(cfg.model_dump()).model == cfg.model  # as the ranks receive it
    d = describe_section(cfg.model, 11)  # what the trainer hands the engine
    assert d.build().blocks[0].fc.weight.shape == (40, 8)
    spec = ModelSpec.from_description(d)
    assert spec.params == 2 * 11 * 8 + 2 * 2 * 40 * 8
    assert dict(spec.tp_divides) == {"MLP width model.width_factor x model.n_embd": 40}


def test_a_kinds_keys_are_checked_by_its_own_class():
    with pytest.raises(ConfigError, match=r"^model.width_factr: unknown key; did you mean "
                                          r"model.width_factor\?$"):
        Config.from_dict({"model": {"kind": "toy_kind", "width_factr": 2}})
    with pytest.raises(ConfigError, match=r"^model.width_factor: Input should be greater"):
        Config.from_dict({"model": {"kind": "toy_kind", "width_factor": 0}})
    with pytest.raises(ConfigError, match=r"^model.n_kv_heads=2: the GPT has no such option "
                                          r"\(model.kind = \"llama\" has\)$"):
        Config.from_dict({"model": {"n_kv_heads": 2}})
    with pytest.raises(ConfigError, match=r"^model.n_kv_headz: unknown key; did you mean "
                                          r"model.n_kv_heads\?$"):
        Config.from_dict({"model": {"kind": "llama", "n_kv_headz": 2}})
    assert type(Config.from_dict({}).model) is GPTModelConfig
    assert type(Config.from_dict({"model": {"kind": "llama"}}).model) is LlamaModelConfig


def test_a_flat_model_table_of_before_still_loads():
    """An old flat [model] table (every field of every kind, at its default where the kind
    has no such field) loads as its kind's class."""
    from shardwise.base.config import ModelConfig

    flat = ModelConfig(kind="llama", n_kv_heads=2).model_dump()
    assert "bias" in flat and "k_bias" in flat  # the GPT's, at their defaults
    m = Config.from_dict({"model": flat}).model
    assert type(m) is LlamaModelConfig and m.n_kv_heads == 2
    gpt = Config.from_dict({"model": ModelConfig(n_layer=2).model_dump()}).model
    assert type(gpt) is GPTModelConfig and gpt.n_layer == 2


def test_help_and_the_reference_list_each_kinds_fields():
    shared = {f.name for f in config_fields() if f.section == "model"}
    assert {"kind", "module", "init_from", "n_layer", "block_size", "vocab_size"} <= shared
    llama = {f.name for f in model_kind_fields("llama")}
    assert {"qk_norm", "attn_logit_softcapping", "n_experts"} <= llama and not llama & shared
    assert {f.name for f in model_kind_fields("gpt")} == {"bias", "activation", "k_bias"}


def test_help_takes_the_kind_and_its_module_from_the_command_line():
    from shardwise.cli.config_args import model_option

    argv = ["--model.kind", "gpt", "--model.module=examples/own_decoder.py", "--model.kind=llama"]
    assert model_option(argv, "kind") == "llama"
    assert model_option(argv, "module") == "examples/own_decoder.py"
    assert model_option(["--parallel.dp", "2"], "kind") is None
