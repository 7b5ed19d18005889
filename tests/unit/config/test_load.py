from __future__ import annotations

import os
import time
import tracemalloc
from pathlib import Path

import pytest

from clustertrain.config.load import dump_config, load_config
from clustertrain.errors import ConfigError
from clustertrain.resolve.load import load_checked_config

CONFIGS = sorted((Path(__file__).parents[3] / "configs").glob("*.*"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    config = load_checked_config(path)
    assert config.name == path.stem
    assert config.train.run_dir or str(config.run_dir) == f"runs/{path.stem}"


def test_yaml_and_toml_give_the_same_config(tmp_path):
    (tmp_path / "a.yaml").write_text("optim:\n  lr: 0.001\ntrain:\n  steps: 7\n")
    (tmp_path / "a.toml").write_text("[optim]\nlr = 0.001\n[train]\nsteps = 7\n")
    assert load_config(tmp_path / "a.yaml") == load_config(tmp_path / "a.toml")


def test_overrides_are_typed_and_nested():
    config = load_config(None, ["optim.lr=3e-4", "optim.betas=[0.9, 0.99]", "model.config.hidden_size=96"])
    assert config.optim.lr == 3e-4
    assert config.optim.betas == (0.9, 0.99)
    assert config.model.config["hidden_size"] == 96
    assert config.model.config["num_hidden_layers"] == 4, "the other default fields stay"


def test_model_config_from_a_file_replaces_the_default(tmp_path):
    (tmp_path / "g.yaml").write_text("model:\n  arch: gpt2\n  config: {n_layer: 2, n_head: 4}\n")
    config = load_config(tmp_path / "g.yaml", ["model.config.n_embd=64"])
    assert config.model.config == {"n_layer": 2, "n_head": 4, "n_embd": 64}


def test_dump_round_trips(tmp_path):
    config = load_config(None, ["train.steps=11"])
    (tmp_path / "c.yaml").write_text(dump_config(config))
    assert load_config(tmp_path / "c.yaml").model_dump(exclude={"name"}) == config.model_dump(exclude={"name"})


def test_dump_keeps_what_was_left_unset(tmp_path):
    """A config written by `slurm submit` (or into a run) loads back as the same run: the default micro batch,
    above a small global batch, is not refused, and a fine-tuned snapshot does not get the from-scratch sizes."""
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2}')
    config = load_config(None, [f"model.path={tmp_path / 'gpt2'}", "train.global_batch_size=4"])
    (tmp_path / "c.yaml").write_text(dump_config(config))
    again = load_config(tmp_path / "c.yaml")
    assert again.train.micro_batch_size == 4
    assert again.model.config_fields == {} and config.model.config_fields == {}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optim.lrr=1"], "config error: unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
        (["trian.steps=3"], "config error: unknown key 'trian' (did you mean 'train'?)"),
        (["optim.lr=abc"], "config error: optim.lr = 'abc': Input should be a valid number"),
        (["optim.lr=-1"], "config error: optim.lr = -1: Input should be greater than 0"),
        (["parallel.strategy=zero4"], "config error: parallel.strategy = 'zero4': Input should be 'ddp', 'zero2'"),
        (["model.config.hiden_size=3"], "unknown key 'model.config.hiden_size' for llama (did you mean 'model.config.hidden_size'?)"),
        (["model.arch=lama"], "model.arch = 'lama' is not a transformers model type (did you mean llama"),
        (["data.sources=[{format: text}]"], "data.sources.0: give exactly one of path or hf_name"),
        (["optim.lr"], "override 'optim.lr' must look like section.key=value"),
    ],
)
def test_bad_values_name_key_value_and_what_is_allowed(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_checked_config(None, overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["optim.lr=-1", "train.steps=0", "metrics.bogus=1"])
    lines = str(info.value).splitlines()
    assert len(lines) == 3 and all(line.startswith("config error:") for line in lines)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("optim: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ConfigError, match="use .yaml, .yml or .toml"):
        load_config(tmp_path / "c.json")


@pytest.mark.timeout(30)
def test_a_fifo_or_a_directory_as_the_config_is_refused_unread(tmp_path):
    """A FIFO nothing writes to would block a read forever; a directory said "not found"."""
    os.mkfifo(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match=r"config file .*c\.yaml is not a regular file \(a FIFO, device or socket\)"):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match=r"config file .* is a directory; give the \.yaml, \.yml or \.toml file"):
        load_config(tmp_path)


def test_config_reference_is_current():
    from clustertrain.config.docs import render_reference

    committed = (Path(__file__).parents[3] / "docs" / "config.md").read_text()
    assert committed == render_reference(), "run: python -m clustertrain.config.docs > docs/config.md"


def test_a_yaml_bomb_is_refused_fast_in_little_memory(tmp_path):
    """A "billion laughs" inside a key that takes a list (9 aliases of 9 aliases ..., 9^10 strings in 485 bytes)
    stops before anything expands it: it took over 3 GB once validated."""
    levels = "abcdefghij"
    (tmp_path / "bomb.yaml").write_text("slurm:\n  setup:\n    - &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
                                        + "".join(f"    - &{b} [{', '.join([f'*{a}'] * 9)}]\n"
                                                  for a, b in zip(levels, levels[1:])))
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ConfigError, match=r"bomb.yaml: aliases expand past 10000 values by \*d at line 7 \(a YAML "
                                              r"bomb\?\); write the values out$"):
            load_config(tmp_path / "bomb.yaml")
        seconds, peak = time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < 1 and peak < 50e6, (seconds, peak)


def test_anchors_aliases_and_merge_keys_load(tmp_path):
    """YAML's own ways of sharing values: an alias of a list, and a merge key (`<<: *base`) whose mapping the keys
    beside it override."""
    (tmp_path / "c.yaml").write_text(
        "data:\n"
        "  sources:\n"
        "    - &corpus {path: a.txt, format: text, weight: 1.0}\n"
        "    - <<: *corpus\n"
        "      path: b.txt\n"
        "    - {<<: [*corpus], weight: 3.0}\n"
        "slurm:\n"
        "  setup: &lines [module load a, module load b]\n"
        "  modules: *lines\n"
    )
    config = load_config(tmp_path / "c.yaml")
    assert [(s.path, s.format, s.weight) for s in config.data.sources] == [
        ("a.txt", "text", 1.0), ("b.txt", "text", 1.0), ("a.txt", "text", 3.0)]
    assert config.slurm.setup == config.slurm.modules == ["module load a", "module load b"]
