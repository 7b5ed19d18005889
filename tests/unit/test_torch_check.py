"""A torch older than clustertrain supports is refused in one line, before `make install` runs pip and when a command
that needs torch starts; torch itself is never a pip dependency (a cluster's ROCm or CUDA build would be replaced)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from clustertrain import cli, torch_check
from clustertrain.torch_check import torch_problem

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version, index", [
    ("2.5.1+rocm6.1", "whl/rocm6.4"),  # Frontier's documented ROCm 6.1 stack
    ("2.6.0+cu124", "whl/cu128"),
    ("2.7.1+cpu", "whl/cpu"),
    ("2.7.1", None),  # PyPI's own build: PyPI has the newer one
])
def test_older_torch_is_refused_with_the_build_to_install(version, index):
    problem = torch_problem(version)
    assert f"has torch {version}" in problem and "torch>=2.8" in problem and "\n" not in problem
    assert (index in problem) if index else ("--index-url" not in problem)


@pytest.mark.parametrize("version", ["2.8.0", "2.8.0+rocm6.4", "2.13.0", "2.10.0a0+git1234", "3.0.0"])
def test_supported_torch_passes(version):
    assert torch_problem(version) is None


def test_no_torch_is_fine_before_install_but_not_for_a_command():
    assert torch_problem(None, missing_ok=True) is None  # make install then installs one
    assert "none is installed" in torch_problem(None)


def test_torch_is_not_a_pip_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.replace(" ", "").startswith("torch")]
    assert project["optional-dependencies"]["torch"] == ["torch>=2.8"]


def test_a_training_command_refuses_and_a_login_node_command_does_not(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "installed_torch", lambda: "2.5.1+rocm6.1")
    assert cli.main(["train", "--set", f"train.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: clustertrain needs torch >= 2.8") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
    assert cli.main(["config", "show"]) == 0


def test_the_pre_install_check_exits_2_on_an_old_torch(tmp_path):
    """`python -m clustertrain.torch_check`, as the Makefile runs it before pip, on a torch 2.5.1 it finds first."""
    info = tmp_path / "torch-2.5.1+rocm6.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.5.1+rocm6.1\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    result = subprocess.run([sys.executable, "-m", "clustertrain.torch_check"], env=env, capture_output=True,
                            text=True, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: clustertrain needs torch >= 2.8 and this environment has torch 2.5.1")
    assert subprocess.run([sys.executable, "-m", "clustertrain.torch_check"], cwd=ROOT).returncode == 0


def test_the_ci_smoke_runs_on_the_oldest_supported_torch():
    oldest = re.search(r"^OLDEST_TORCH := (\d+)\.(\d+)\.", (ROOT / "Makefile").read_text(), re.M)
    assert tuple(map(int, oldest.groups())) == torch_check.MIN_TORCH


def test_the_smoke_subset_names_tests_that_exist():
    """A renamed test would leave `make test-oldest` collecting nothing of it."""
    makefile = (ROOT / "Makefile").read_text()
    smoke = re.search(r"^SMOKE := (.*?)\n(?=\S)", makefile, re.M | re.S).group(1)
    ids = re.findall(r"(tests/[\w/]+\.py)::(\w+)", smoke)
    assert len(ids) == 5
    for path, name in ids:
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{path}::{name}"

