"""A model option is declared once (issue 39): ``attn_logit_softcapping`` and ``qk_norm``
are each named in at most 4 ``.py`` files of ``src/shardwise`` (today 3: the ``[model]``
field, ``base.model_config``; the model that implements it, ``models.llama``; the Hugging
Face table of the options each arch fixes, ``models.hf.arch.OPTIONS``). The imports, the
archs' ``holds``, the exports' refusals and the planner's named Gemmas read that table or
the model's description instead of naming the field again. Read from the source as text
(nothing imported for the count)."""

from __future__ import annotations

from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "shardwise"
LIMIT = 4  # files that may name one option


@pytest.mark.parametrize("option", ["attn_logit_softcapping", "qk_norm"])
def test_a_model_option_is_named_in_at_most_4_files(option):
    files = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                   if option in p.read_text(encoding="utf-8"))
    assert files and len(files) <= LIMIT, f"{option} is named in {len(files)} files: {files}"


def test_the_hf_option_table_names_fields_of_the_llama_section():
    """Each option ``OPTIONS`` fixes and each cap ``SOFT_CAPS`` reads is a field of the
    Llama's ``[model]`` section, and ``requirements`` lists it ("no qk_norm", "qk_norm")."""
    from shardwise.base.model_config import LlamaModelConfig
    from shardwise.models.hf.arch import OPTIONS, SOFT_CAPS, all_requirements, requirements

    named = {k for table in (*OPTIONS.values(), *SOFT_CAPS.values()) for k in table}
    assert named <= set(LlamaModelConfig.model_fields), named - set(LlamaModelConfig.model_fields)
    assert requirements("Qwen3") == "no qkv_bias, qk_norm"
    assert requirements("Gemma3").endswith("sandwich_norm, qk_norm, no attn_logit_softcapping")
    assert all(f"{arch}" in all_requirements() for arch in OPTIONS)


def test_named_sizes_are_sections_of_their_kind():
    """A named GPT or Llama (``planner.specs.NAMED``) is the spec of its kind's ``[model]``
    section (``gpt_section`` / ``llama_section``, ``ModelSpec.from_section``), and the
    section ``plan --emit-toml`` writes for it reads back as the same spec."""
    from shardwise.base.model_config import GPTModelConfig, LlamaModelConfig
    from shardwise.planner.specs import NAMED, ModelSpec, gpt_section, llama_section

    assert type(gpt_section(12, 768, 12, 50257, 1024)) is GPTModelConfig
    assert type(llama_section(32, 4096, 32, 8, 14336, 128256, 8192, 5e5)) is LlamaModelConfig
    assert ModelSpec.from_section(llama_section(32, 4096, 32, 8, 14336, 128256, 8192, 5e5),
                                  "llama3-8b") == NAMED["llama3-8b"]
    plain = [spec for spec in NAMED.values() if spec.description is None]
    assert len(plain) == 29  # all but the described DeepSeeks and Gemmas
    for spec in plain:
        assert ModelSpec.from_section(spec.section(), spec.name) == spec, spec.name
