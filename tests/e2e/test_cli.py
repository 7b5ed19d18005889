"""The CLI as users meet it: errors are one line with exit code 2, never a traceback.

Errors found while the config is read are checked in-process, through the CLI's own main() (a process costs
seconds of imports); those found by a run, one rank or `--nproc` ranks, by real processes.
"""

from __future__ import annotations

import pytest
from helpers import run_cli

from clustertrain.cli import main

MISSING_SOURCE = ("data.sources=[{format: text, path: /nonexistent/*.txt}]",
                  "error: data source '/nonexistent/*.txt': no such file, directory or matching files")


def assert_one_line(code: int, stderr: str, message: str) -> None:
    assert code == 2, stderr[-3000:]
    assert stderr.startswith(message), stderr[-3000:]
    assert len(stderr.strip().splitlines()) == 1
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--set", "optim.lrr=1"], "error: config error: unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
        (["train", "--set", "train.steps=ten"], "error: config error: train.steps = 'ten': Input should be a valid integer"),
        (["train", "--set", "optim.warmup_steps=-5"], "error: config error: optim.warmup_steps = -5: Input should be greater than or equal to 0"),
        (["train", "missing.yaml"], "error: config file not found: missing.yaml"),
        (["train", "--nproc", "0"], "error: --nproc 0: must be at least 1"),
    ],
)
def test_config_errors_are_one_line_and_exit_2(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default run directory, runs/default, is relative to it
    code = main(args)
    assert_one_line(code, capsys.readouterr().err, message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]], ids=["one-rank", "two-ranks"])
def test_a_run_s_user_error_is_one_line_and_exit_2_and_writes_nothing(nproc, tmp_path):
    data, message = MISSING_SOURCE
    result = run_cli("train", *nproc, "--set", data, "--set", "data.vocab_size=300", cwd=tmp_path)
    assert_one_line(result.returncode, result.stderr, message)
    assert list(tmp_path.iterdir()) == []  # a refused start writes nothing: no runs/default/status.json


def test_bad_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["train", "--no-such-flag"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_config_show_prints_the_resolved_config(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("optim:\n  lr: 0.01\n")
    assert main(["config", "show", str(tmp_path / "c.yaml"), "--set", "train.steps=9"]) == 0
    shown = capsys.readouterr().out
    assert "name: c\n" in shown
    assert "  lr: 0.01\n" in shown and "  steps: 9\n" in shown
    assert "strategy: ddp" in shown


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


def test_data_audit_without_samples_is_a_user_error(tmp_path, capsys):
    assert main(["data", "audit", str(tmp_path)]) == 2
    assert "samples.jsonl not found: train with data.audit: true" in capsys.readouterr().err
