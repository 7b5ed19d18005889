"""Model-family knowledge lives in one file per family, and a file is all a family takes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from clustertrain.model import families as families_package
from clustertrain.model.families import families, family_of

PACKAGE = Path(families_package.__file__).parents[2]


def test_every_family_file_is_found_and_owns_its_model_types():
    files = sorted(p.stem for p in (PACKAGE / "model" / "families").glob("*.py") if p.stem != "__init__")
    assert files == ["gpt2", "granite", "llama", "opt", "phi", "starcoder2"]
    found = families()
    for name in files:
        module = __import__(f"clustertrain.model.families.{name}", fromlist=["FAMILY"])
        assert all(found[model_type] is module.FAMILY for model_type in module.FAMILY.model_types)
    assert {"llama", "qwen2", "mistral", "gemma", "phi3", "qwen3", "olmo2", "mixtral", "gpt2", "opt", "granite",
            "phi", "starcoder2"} <= set(found)
    assert family_of("bloom") is None
    assert family_of("opt").tp_plan and family_of("opt").local_head_counts and family_of("opt").pp_plan
    assert family_of("llama").tp_plan is None  # transformers ships it


def test_a_new_file_is_a_new_family_and_a_model_type_has_one(tmp_path, monkeypatch):
    monkeypatch.setattr(families_package, "__path__", [*families_package.__path__, str(tmp_path)])
    (tmp_path / "bloomish.py").write_text(
        "from clustertrain.model.families import Family, llama\n"
        "FAMILY = Family(model_types=('bloomish',), embed=llama.embed, decode=llama.rope_decoder(llama.full_attention),"
        " final=llama.final)\n")
    families.cache_clear()
    try:
        assert family_of("bloomish").model_types == ("bloomish",)
        (tmp_path / "again.py").write_text((tmp_path / "bloomish.py").read_text())
        families.cache_clear()
        with pytest.raises(AssertionError, match="'bloomish' is in two family files"):
            families()
    finally:
        families.cache_clear()


def test_parallel_code_names_no_model_type():
    """Tensor and pipeline parallelism ask the families; a model type spelled out in parallel/ is knowledge
    that belongs in a family file."""
    model_types = set(families())
    named = [f"{path.name}:{node.lineno}: {node.value!r}"
             for path in (PACKAGE / "parallel").glob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and node.value in model_types]
    assert not named, named
