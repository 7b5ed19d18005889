"""`clustertrain env CONFIG`: the job script's environment block, for ranks started by hand."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from clustertrain.cli import main


def test_env_prints_the_job_scripts_environment_block_as_it_stands_there(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sets = ["--set=slurm.preset=frontier", "--set=slurm.env={MY_SITE_VAR: here}"]
    assert main(["env", *sets]) == 0
    env = capsys.readouterr().out
    assert main(["slurm", "render", *sets]) == 0
    script = capsys.readouterr().out
    assert "export NCCL_SOCKET_IFNAME=hsn0" in env and "export MY_SITE_VAR=here" in env
    assert env.startswith("#") and env in script  # the same lines, in the same order


def test_its_exports_take_effect_in_a_shell():
    result = subprocess.run(["bash", "-c", f'eval "$("{sys.executable}" -m clustertrain env '
                             '--set "slurm.env={MY_SITE_VAR: from-the-preset}")"; echo "$MY_SITE_VAR"'],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and result.stdout.strip().splitlines()[-1] == "from-the-preset", result.stderr


@pytest.mark.parametrize("override, says", [("slurm.preset=nowhere", "slurm.preset"),
                                            ("slurm.no_such_key=1", "slurm.no_such_key")])
def test_a_bad_preset_or_key_is_one_line_and_exit_2(capsys, override, says):
    assert main(["env", f"--set={override}"]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("cpus_on_node, tasks, expected", [(None, 1, "unset"), ("8", 3, "2"), ("2", 4, "1")])
def test_omp_num_threads_is_the_nodes_cores_in_an_allocation_and_unset_outside_never_empty(
        capsys, tmp_path, cpus_on_node, tasks, expected):
    """CPU-only nodes (the generic preset): only the job script counts the cores; `env` exports no value it lacks."""
    assert main(["env", f"--set=slurm.tasks_per_node={tasks}"]) == 0
    (tmp_path / "env.sh").write_text(capsys.readouterr().out)
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "SLURM_CPUS_ON_NODE")}
    result = subprocess.run(["bash", "-c", 'eval "$(cat env.sh)"; echo "${OMP_NUM_THREADS-unset}"'], cwd=tmp_path,
                            env={**environ, **({"SLURM_CPUS_ON_NODE": cpus_on_node} if cpus_on_node else {})},
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0 and result.stdout.strip() == expected, result.stderr


def test_a_preset_that_knows_its_cores_exports_its_count(capsys):
    assert main(["env", "--set=slurm.preset=frontier"]) == 0
    assert "export OMP_NUM_THREADS=7\n" in capsys.readouterr().out
