"""Paths in configs expand `$VAR`, `${VAR}` and `~` (the LoRA walkthrough keeps models, tokenizers and data under
`$SCRATCH_ROOT/...`); an unset variable is one line naming it and the key, exit 2."""

from __future__ import annotations

import os

import pytest

from clustertrain.cli import main
from clustertrain.config.load import load_config

HOME = os.path.expanduser("~")
# every path key, each with one of the spellings
EXPANDED = {
    "model.path": ("$SCRATCH_ROOT/llama-models-cache", "/lustre/me/llama-models-cache"),
    "data.tokenizer": ("${SCRATCH_ROOT}/llama-tokenizers-cache", "/lustre/me/llama-tokenizers-cache"),
    "data.sources": ('[{path: "${SCRATCH_ROOT}/data_cache/*.arrow"}]', "/lustre/me/data_cache/*.arrow"),
    "data.eval_sources": ("[{path: $SCRATCH_ROOT/held-out.jsonl}]", "/lustre/me/held-out.jsonl"),
    "data.cache_dir": ("~/.cache/ct", f"{HOME}/.cache/ct"),
    "train.run_dir": ("~/runs/$RUN-${RUN}", f"{HOME}/runs/sft-sft"),
    "train.resume": ("$SCRATCH_ROOT/runs/a/checkpoints/step-000100", "/lustre/me/runs/a/checkpoints/step-000100"),
    "slurm.output": ("$SCRATCH_ROOT/logs/%j.out", "/lustre/me/logs/%j.out"),
    "slurm.preset": ("~/presets/mine.yaml", f"{HOME}/presets/mine.yaml"),
    "data.seq_len": ("64", 64),  # not a path: untouched
}


def value(config, key: str):
    node = config
    for part in key.split("."):
        node = getattr(node, part)
    return node[0].path if key in ("data.sources", "data.eval_sources") else node


@pytest.mark.parametrize("key", EXPANDED)
def test_a_path_key_expands_variables_braces_and_tilde(key, monkeypatch):
    monkeypatch.setenv("SCRATCH_ROOT", "/lustre/me")
    monkeypatch.setenv("RUN", "sft")
    given, expected = EXPANDED[key]
    assert value(load_config(None, [f"{key}={given}"]), key) == expected


@pytest.mark.parametrize("given", ["a$5/b", "cost$/x", "not~home/x", "/plain/path"])
def test_what_is_no_variable_and_no_leading_tilde_stays_as_written(given):
    assert load_config(None, [f"model.path={given}"]).model.path == given


@pytest.mark.parametrize(("key", "given", "says"), [
    ("model.path", "$SCRATCH_ROOT/llama", "model.path = '$SCRATCH_ROOT/llama': $SCRATCH_ROOT is not set"),
    ("data.tokenizer", "${SCRATCH_ROOT}/tok", "data.tokenizer = '${SCRATCH_ROOT}/tok': $SCRATCH_ROOT is not set"),
    ("train.run_dir", "$EMPTY/runs", "train.run_dir = '$EMPTY/runs': $EMPTY is empty"),
    ("slurm.preset", "${BAD-NAME}/p.yaml", "slurm.preset = '${BAD-NAME}/p.yaml': ${BAD-NAME} is not an environment "
                                           "variable's name"),
])
def test_an_unset_variable_is_one_line_naming_it_and_the_key(key, given, says, monkeypatch, capsys):
    monkeypatch.delenv("SCRATCH_ROOT", raising=False)
    monkeypatch.setenv("EMPTY", "")
    assert main(["config", "show", f"--set={key}={given}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config error: ") and says in err and len(err.strip().splitlines()) == 1, err
