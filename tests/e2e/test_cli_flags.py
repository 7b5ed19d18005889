"""Flags as users of torchtitan and litgpt type them: `--section.key VALUE` next to `--set`, list items by index,
on every command that takes a config; `--version`; help on a bare `clustertrain`; `--log-level`."""

from __future__ import annotations

import io
import logging
import warnings
from importlib import metadata

import pytest
import yaml
from helpers import TINY, run_cli
from rich.console import Console

from clustertrain.cli import main
from clustertrain.cli.logs import setup_logging
from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import MetricsLogger

FORMS = ["--set", "data.sources.0.path=a.txt", "--data.sources.0.weight", "2", "--optim.lr=1e-3",
         "--train.steps", "7", "--set=train.seed=5", "--data.sources.1.hf_name", "org/set"]


def test_config_show_takes_every_form(capsys):
    assert main(["config", "show", *FORMS]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert [(s["path"], s["hf_name"], s["weight"]) for s in config["data"]["sources"]] == \
        [("a.txt", None, 2.0), (None, "org/set", 1.0)]
    assert (config["optim"]["lr"], config["train"]["steps"], config["train"]["seed"]) == (1e-3, 7, 5)


def test_config_check_takes_them(capsys):
    assert main(["config", "check", "--world", "2", "--train.steps", "7", "--data.seq_len=64",
                 "--set", "train.global_batch_size=4"]) == 0
    line = capsys.readouterr().out
    assert "global batch 4 sequences × 64 tokens" in line and line.rstrip().endswith("; 7 steps")


def test_slurm_render_and_env_take_them(capsys):
    assert main(["slurm", "render", "--slurm.nodes", "3", "--train.steps=7", "--slurm.modules.0", "rocm/6.2"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=3" in script and "--set=train.steps=7" in script and "rocm/6.2" in script
    assert main(["slurm", "render", "--log-level", "warning"]) == 0
    assert "train --log-level warning" in capsys.readouterr().out
    assert main(["env", "--slurm.modules.0", "rocm/6.2", "--slurm.modules.1=cray-python"]) == 0
    out = capsys.readouterr().out
    assert out.index("rocm/6.2") < out.index("cray-python")


@pytest.mark.parametrize(("args", "steps"), [(["--set", "train.steps=5", "--train.steps", "3"], 3),
                                             (["--train.steps", "3", "--set", "train.steps=5"], 5)])
def test_the_last_of_set_and_a_key_flag_wins(args, steps, capsys):
    assert main(["config", "show", *args]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["steps"] == steps


def test_train_takes_them(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("train", *(f"--set={o}" for o in TINY), f"--train.run_dir={run_dir}", "--train.steps", "2",
                     "--optim.lr", "1e-3", "--data.sources.0.max_bytes", "200000", "--data.sources.0.weight=2",
                     "--log-level", "warning")
    assert result.returncode == 0, result.stderr[-3000:]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (config["train"]["steps"], config["optim"]["lr"]) == (2, 1e-3)
    assert (config["data"]["sources"][0]["max_bytes"], config["data"]["sources"][0]["weight"]) == (200000, 2.0)


@pytest.mark.parametrize(("args", "message"), [
    (["config", "show", "--optim.lrr", "1"], "error: config error: unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
    (["config", "show", "--optimm.lr", "1"], "error: config error: unknown key 'optimm' (did you mean 'optim'?)"),
    (["plan", "--optim.lr"], "error: --optim.lr needs a value: --optim.lr VALUE or --optim.lr=VALUE"),
])
def test_a_wrong_key_flag_is_one_line_and_exit_2(args, message, capsys):
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == message


def test_a_key_flag_on_a_command_without_a_config_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["status", "runs/x", "--optim.lr", "1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: clustertrain status") and "--optim.lr: `clustertrain status` takes no config" in err


def test_a_process_exits_2_on_a_wrong_key_flag(tmp_path):
    result = run_cli("train", "--train.stepz", "3", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: config error: unknown key 'train.stepz' (did you mean 'train.steps'?)"
    assert list(tmp_path.iterdir()) == []


def test_version_names_clustertrain_and_torch(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == \
        f"clustertrain {metadata.version('clustertrain')} (torch {metadata.version('torch')})"


def test_a_bare_clustertrain_prints_the_help_and_exits_0(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: clustertrain") and "config keys" in out and "--log-level" in out


def test_debug_shows_the_arguments_as_read(capsys):
    assert main(["--log-level", "debug", "config", "show", "--optim.lr", "1e-3"]) == 0
    err = capsys.readouterr().err
    assert "clustertrain config, arguments as read: ['--log-level', 'debug', 'config', 'show', " \
           "'--set=optim.lr=1e-3']" in err


def logger(buffer: io.StringIO) -> MetricsLogger:
    import tempfile

    return MetricsLogger(RunDir(tempfile.mkdtemp()), total_steps=1, tensorboard=False, progress="lines",
                         console=Console(file=buffer, width=200))


@pytest.mark.parametrize(("level", "shown"), [("info", ["note", "warning: careful"]), ("warning", ["warning: careful"]),
                                              ("error", [])])
def test_log_level_decides_which_lines_a_run_prints(level, shown):
    setup_logging(level)
    buffer = io.StringIO()
    run = logger(buffer)
    run.info("note")
    run.info("warning: careful")
    run.close()
    assert buffer.getvalue().splitlines() == shown


@pytest.mark.parametrize(("level", "shown"), [("info", False), ("debug", True)])
def test_library_deprecations_show_only_when_debugging(level, shown, capsys):
    with warnings.catch_warnings():
        warnings.resetwarnings()
        setup_logging(level)
        warnings.warn_explicit("`foo` is deprecated", FutureWarning, "modeling_utils.py", 1,
                               module="transformers.modeling_utils", registry={})
        warnings.warn_explicit("a real problem", UserWarning, "ours.py", 1, module="clustertrain.x", registry={})
    err = capsys.readouterr().err
    assert ("is deprecated" in err) == shown
    assert "warning: ours.py:1: UserWarning: a real problem" in err


def test_only_rank_0_logs_unless_every_rank_is_asked_to(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    setup_logging("info")
    logging.getLogger("clustertrain.test").warning("from rank 1")
    assert capsys.readouterr().err == ""
    setup_logging("info", all_ranks=True)
    logging.getLogger("clustertrain.test").warning("from rank 1")
    assert capsys.readouterr().err == "warning: [rank 1] from rank 1\n"
