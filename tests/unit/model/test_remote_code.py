"""A model or tokenizer folder that ships Python code (an `auto_map` in its config.json or tokenizer_config.json)
is refused in one line by every loader, and the code never runs: no loader trusts remote code, none asks on a
terminal. An auto_map beside a class transformers has loads that class, still without running the code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from clustertrain.config.data_schema import DataConfig

from clustertrain.config.schema import ModelConfig
from clustertrain.data.tokenize import load_tokenizer
from clustertrain.errors import CheckpointError, ConfigError, DataError, UserError
from clustertrain.inference import load_for_inference
from clustertrain.model.build import build_hf_config
from clustertrain.resolve.load import load_checked_config
from helpers import ONE_THREAD, write_tiny_repo

PROMPT = "Do you wish to run the custom code"
REFUSAL = "clustertrain never runs code from a model or tokenizer folder"


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A clean folder: a tiny Llama and a byte-level BPE tokenizer, as save_pretrained writes them."""
    return write_tiny_repo(tmp_path_factory.mktemp("clean"))


def with_code(repo: Path, dest: Path, file: str, **fields) -> Path:
    """A copy of `repo` whose `file` gets `fields` (an auto_map among them) and a custom.py that, if ever
    imported, leaves `dest/RAN` behind."""
    shutil.copytree(repo, dest)
    (dest / "custom.py").write_text(
        f"open({str(dest / 'RAN')!r}, 'w').close()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        "class CustomTokenizer(PreTrainedTokenizerFast): pass\n"
        "class CustomConfig(LlamaConfig): model_type = 'custom'\n"
        "class CustomModel(LlamaForCausalLM): config_class = CustomConfig\n"
    )
    data = json.loads((dest / file).read_text())
    (dest / file).write_text(json.dumps({**data, **fields}))
    return dest


def tokenizer_with_code(repo: Path, dest: Path, tokenizer_class: str = "CustomTokenizer") -> Path:
    auto_map = {"AutoTokenizer": ["custom.CustomTokenizer", "custom.CustomTokenizer"]}
    return with_code(repo, dest, "tokenizer_config.json", auto_map=auto_map, tokenizer_class=tokenizer_class)


def model_with_code(repo: Path, dest: Path, model_type: str = "custom") -> Path:
    auto_map = {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"}
    return with_code(repo, dest, "config.json", auto_map=auto_map, model_type=model_type)


def assert_refused(error: pytest.ExceptionInfo, folder: Path, file: str, capsys) -> None:
    message = str(error.value)
    assert isinstance(error.value, UserError)
    assert REFUSAL in message and str(folder / file) in message, message
    assert "\n" not in message, message
    assert PROMPT not in message and PROMPT not in "".join(capsys.readouterr())
    assert not (folder / "RAN").exists(), "the folder's code ran"


def test_train_refuses_a_tokenizer_that_ships_code(repo, tmp_path, capsys):
    folder = tokenizer_with_code(repo, tmp_path / "tok")
    with pytest.raises(DataError) as error:
        load_tokenizer(DataConfig(tokenizer=str(folder)))
    assert_refused(error, folder, "tokenizer_config.json", capsys)
    assert str(error.value).startswith("data.tokenizer: ")


def test_a_snapshot_whose_config_ships_code_is_refused(repo, tmp_path, capsys):
    folder = model_with_code(repo, tmp_path / "model")
    with pytest.raises(ConfigError) as error:  # `config show`, `train`, `plan`: the config's check of model.path
        load_checked_config(None, [f"model.path={folder}"])
    assert_refused(error, folder, "config.json", capsys)
    assert "model.path" in str(error.value)
    with pytest.raises(ConfigError) as error:  # the run's own build of the snapshot's config
        build_hf_config(ModelConfig(path=str(folder)), None, 512)
    assert_refused(error, folder, "config.json", capsys)


@pytest.mark.parametrize("part", ["tokenizer", "model"])
def test_generate_refuses_a_folder_that_ships_code(part, repo, tmp_path, capsys):
    make, file = (tokenizer_with_code, "tokenizer_config.json") if part == "tokenizer" else (model_with_code,
                                                                                          "config.json")
    folder = make(repo, tmp_path / part)
    with pytest.raises(CheckpointError) as error:
        load_for_inference(folder)
    assert_refused(error, folder, file, capsys)


def test_an_adapter_on_a_base_that_ships_code_is_refused(repo, tmp_path, capsys):
    base = model_with_code(repo, tmp_path / "base")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": 2,
         "target_modules": ["q_proj"]}))
    with pytest.raises(DataError) as error:
        load_for_inference(adapter)
    assert_refused(error, base, "config.json", capsys)


def test_import_and_export_refuse_code(repo, tmp_path, capsys):
    from clustertrain.checkpoint.export import import_hf, open_for_export

    folder = model_with_code(repo, tmp_path / "model")
    with pytest.raises(CheckpointError) as error:
        import_hf(folder, tmp_path / "imported")
    assert_refused(error, folder, "config.json", capsys)
    assert not (tmp_path / "imported").exists()
    # A checkpoint folder whose tokenizer was swapped for one that ships code.
    checkpoint = import_hf(repo, tmp_path / "checkpoint")
    shutil.rmtree(checkpoint / "tokenizer")
    tokenizer_with_code(repo, checkpoint / "tokenizer")
    with pytest.raises(CheckpointError) as error:
        open_for_export(checkpoint)
    assert_refused(error, checkpoint / "tokenizer", "tokenizer_config.json", capsys)


def test_auto_map_beside_a_transformers_class_loads_that_class_and_runs_nothing(repo, tmp_path):
    """Hub snapshots such as Phi-3's name code in auto_map and a model_type that transformers has: it loads its
    own class, which clustertrain allows."""
    tokenizer = tokenizer_with_code(repo, tmp_path / "tok", tokenizer_class="PreTrainedTokenizerFast")
    assert load_tokenizer(DataConfig(tokenizer=str(tokenizer))).eos_token == "<eos>"
    model = model_with_code(repo, tmp_path / "model", model_type="llama")
    loaded, _ = load_for_inference(model)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert not (tokenizer / "RAN").exists() and not (model / "RAN").exists()


def test_generate_with_such_a_folder_exits_2_in_one_line_without_a_prompt(repo, tmp_path):
    """A real process with no terminal on stdin: transformers' question would land inside its error."""
    folder = tokenizer_with_code(repo, tmp_path / "tok")
    result = subprocess.run([sys.executable, "-m", "clustertrain", "generate", str(folder), "--prompt", "the",
                             "--device", "cpu"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=120, env={**os.environ, **ONE_THREAD})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and REFUSAL in lines[0], result.stderr
    assert PROMPT not in result.stdout + result.stderr
    assert not (folder / "RAN").exists()
