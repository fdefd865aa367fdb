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
