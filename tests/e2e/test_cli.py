"""The CLI as users meet it: errors are one line with exit code 2, never a traceback."""

from __future__ import annotations

import pytest
from helpers import run_cli


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--set", "optim.lrr=1"], "error: config error: unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
        (["train", "--set", "train.steps=ten"], "error: config error: train.steps = 'ten': Input should be a valid integer"),
        (["train", "--set", "optim.warmup_steps=-5"], "error: config error: optim.warmup_steps = -5: Input should be greater than or equal to 0"),
        (["train", "missing.yaml"], "error: config file not found: missing.yaml"),
        (["train", "--nproc", "0"], "error: --nproc 0: must be at least 1"),
        (["train", "--set", "data.sources=[{format: text, path: /nonexistent/*.txt}]", "--set", "data.vocab_size=300"],
         "error: data source '/nonexistent/*.txt': no such file, directory or matching files"),
        (["train", "--nproc", "2", "--set", "data.sources=[{format: text, path: /nonexistent/*.txt}]"],
         "error: data source '/nonexistent/*.txt': no such file, directory or matching files"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(args, message):
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stderr.startswith(message)
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_bad_flag_exits_2():
    result = run_cli("train", "--no-such-flag")
    assert result.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in result.stderr


def test_config_show_prints_the_resolved_config(tmp_path):
    (tmp_path / "c.yaml").write_text("optim:\n  lr: 0.01\n")
    result = run_cli("config", "show", str(tmp_path / "c.yaml"), "--set", "train.steps=9")
    assert result.returncode == 0
    assert "name: c\n" in result.stdout
    assert "  lr: 0.01\n" in result.stdout and "  steps: 9\n" in result.stdout
    assert "strategy: ddp" in result.stdout


def test_console_script_and_python_dash_m_agree():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "clustertrain"
    assert script.exists(), "the clustertrain console script is not installed"
    console = subprocess.run([script, "config", "show"], capture_output=True, text=True)
    module = run_cli("config", "show")
    assert console.returncode == module.returncode == 0
    assert console.stdout == module.stdout


def test_tokenizer_train_writes_a_loadable_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    (tmp_path / "docs").mkdir()
    for i in range(20):
        (tmp_path / "docs" / f"{i}.txt").write_text(f"document {i} about rivers and mountains " * 20)
    out = tmp_path / "tok"
    result = run_cli("tokenizer", "train", str(out), "--set", f"data.sources=[{{path: {tmp_path / 'docs'}}}]",
                     "--set", "data.vocab_size=300")
    assert result.returncode == 0, result.stderr
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer("rivers and mountains").input_ids) == "rivers and mountains"
    again = run_cli("tokenizer", "train", str(out))
    assert again.returncode == 2 and "is not empty" in again.stderr


def test_data_audit_without_samples_is_a_user_error(tmp_path):
    result = run_cli("data", "audit", str(tmp_path))
    assert result.returncode == 2
    assert "samples.jsonl not found: train with data.audit: true" in result.stderr
