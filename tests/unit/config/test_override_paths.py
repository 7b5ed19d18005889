"""Overrides that index lists (`data.sources.0.path=...`), and what they refuse, in one line each."""

from __future__ import annotations

import pytest

from clustertrain.config.load import load_config, set_dotted
from clustertrain.errors import ConfigError


def test_an_index_sets_one_item_of_a_list_from_the_file(tmp_path):
    (tmp_path / "c.yaml").write_text("data:\n  sources:\n    - {path: a.txt, weight: 1}\n    - {path: b.txt}\n")
    config = load_config(tmp_path / "c.yaml", ["data.sources.1.weight=3", "data.sources.0.path=z.txt"])
    assert [(s.path, s.weight) for s in config.data.sources] == [("z.txt", 1.0), ("b.txt", 3.0)]


def test_the_index_past_the_end_appends_and_a_list_not_given_starts_empty():
    config = load_config(None, ["data.sources.0.path=a.txt", "data.sources.1.hf_name=org/set",
                                "data.sources.1.weight=2"])
    assert [(s.path, s.hf_name, s.weight) for s in config.data.sources] == [("a.txt", None, 1.0),
                                                                          (None, "org/set", 2.0)]
    assert config.data.sources[0].format == "auto", "not the default stdlib source with a path added"


def test_an_index_sets_a_value_of_a_list_of_values():
    config = load_config(None, ["optim.betas=[0.9, 0.95]", "optim.betas.1=0.99", "lora.target_modules=[q_proj]",
                                "lora.target_modules.1=v_proj"])
    assert config.optim.betas == (0.9, 0.99)
    assert config.lora.target_modules == ["q_proj", "v_proj"]


def test_an_index_into_a_default_list_of_values_changes_that_item():
    assert load_config(None, ["optim.betas.1=0.98"]).optim.betas == (0.9, 0.98)
    assert load_config(None, ["optim.lr=1e-3", "optim.betas.0=0.8"]).optim.betas == (0.8, 0.95)


def test_later_overrides_win_over_earlier_ones_at_any_depth():
    config = load_config(None, ["data.sources=[{path: a.txt}]", "data.sources.0.path=b.txt",
                                "data.sources=[{path: c.txt}]"])
    assert [s.path for s in config.data.sources] == ["c.txt"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.sources.2.path=x"], "override data.sources.2.path: data.sources has no items here (an override starts "
                                "the list; a default one is replaced); give one of them, or 0 to append one"),
    (["optim.betas.5=0.9"], "override optim.betas.5: optim.betas has 2 item(s), index 0 to 1; give one of them, or "
                            "2 to append one"),
    (["data.sources=[{path: a}]", "data.sources.x.path=b"],
     "override data.sources.x.path: data.sources is a list; index its items by number, e.g. data.sources.0"),
    (["optim.betas=[0.9, 0.95]", "optim.betas.0.x=1"], "override optim.betas.0.x: optim.betas.0 is a value, "
                                                      "not a section"),
    (["data.sources.0.paht=a"], "config error: unknown key 'data.sources.0.paht' (did you mean "
                                "'data.sources.0.path'?)"),
])
def test_bad_indexes_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert str(error.value).splitlines()[0] == message


def test_set_dotted_builds_lists_where_an_index_follows():
    tree: dict = {}
    set_dotted(tree, "a.0.b", 1)
    set_dotted(tree, "a.1", {"c": 2})
    set_dotted(tree, "a.0.d.0", "x")
    assert tree == {"a": [{"b": 1, "d": ["x"]}, {"c": 2}]}
