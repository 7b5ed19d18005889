"""slurm.doctor (`slurm submit --doctor`): the job runs `clustertrain doctor` before training and stops on a
failure; and the one-line warnings of a rank started by hand on a preset's cluster."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from clustertrain.cli import main
from clustertrain.config.load import load_config
from clustertrain.launch.slurm import rank_start_warnings, render_script

FIXED = ["slurm.python=/opt/venv/bin/python", "train.run_dir=/scratch/runs/llama", "slurm.time=02:00:00"]


def render(tmp_path: Path, *overrides: str) -> str:
    config = load_config(None, [*FIXED, *overrides])
    return render_script(config, ["/work/project/llama.yaml"], tmp_path, "llama.yaml")


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_the_doctor_step_runs_before_training_and_writes_doctor_json(tmp_path, launcher):
    script = render(tmp_path, "slurm.doctor=true", f"slurm.launcher={launcher}")
    doctor = script.index("-m clustertrain doctor /work/project/llama.yaml --output /scratch/runs/llama/doctor.json "
                          '|| end_job "$?"')
    assert script.index("slurm job-start") < doctor < script.index("-m clustertrain train")
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0
    assert "clustertrain doctor" not in render(tmp_path, f"slurm.launcher={launcher}")


def test_slurm_render_doctor_sets_slurm_doctor(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["slurm", "render", "--doctor", *(f"--set={o}" for o in FIXED)]) == 0
    assert "-m clustertrain doctor --set=" in capsys.readouterr().out


def fake_job(tmp_path: Path, doctor_exit: int) -> list[str]:
    """Run the rendered script with srun and python replaced by stubs that log their arguments: the order of the
    steps, as the job would take them."""
    log, bin_dir = tmp_path / "calls.log", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"\n')
    python = bin_dir / "python"
    python.write_text(f'#!/bin/bash\necho "$3 $4" >> {log}\n'
                      f'if [ "$3" = doctor ]; then exit {doctor_exit}; fi\n')
    for stub in (python, bin_dir / "srun"):
        stub.chmod(0o755)
    script = render(tmp_path, "slurm.doctor=true", f"slurm.python={python}")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, timeout=60, check=False, capture_output=True)
    return [line.split()[0] + (" " + line.split()[1] if line.startswith("slurm") else "")
            for line in log.read_text().splitlines()]


def test_a_failed_doctor_ends_the_job_before_it_trains(tmp_path):
    assert fake_job(tmp_path, doctor_exit=1) == ["slurm job-start", "doctor", "slurm job-end"]


def test_a_passing_doctor_lets_the_job_train(tmp_path):
    assert fake_job(tmp_path, doctor_exit=0) == ["slurm job-start", "doctor", "train", "slurm job-end"]


SRUN_RANK0 = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
              "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "frontier00001"}
TORCHRUN_RANK0 = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize("environ, preset, warns", [
    ({**SRUN_RANK0, "SLURM_CLUSTER_NAME": "frontier"}, "frontier", True),
    ({**TORCHRUN_RANK0, "TORCHELASTIC_RUN_ID": "none", "SLURM_CLUSTER_NAME": "frontier"}, "frontier", True),
    ({**SRUN_RANK0, "SLURM_PROCID": "1", "SLURM_CLUSTER_NAME": "frontier"}, "frontier", False),  # rank 0 talks
    ({**TORCHRUN_RANK0, "SLURM_CLUSTER_NAME": "frontier"}, "frontier", False),  # --nproc: no TORCHELASTIC_RUN_ID
    ({"SLURM_CLUSTER_NAME": "frontier"}, "frontier", False),  # plain python
    ({**SRUN_RANK0, "SLURM_CLUSTER_NAME": "andes"}, "frontier", False),  # not the preset's cluster
    ({**SRUN_RANK0, "SLURM_CLUSTER_NAME": "frontier"}, "generic", False),  # a preset without cluster_names
], ids=["srun", "torchrun", "srun-rank-1", "nproc", "plain", "elsewhere", "generic"])
def test_a_rank_started_by_hand_on_the_presets_cluster_warns_per_missing_variable(environ, preset, warns):
    slurm = load_config(None, [f"slurm.preset={preset}"]).slurm
    lines = rank_start_warnings("c.yaml", slurm, {**environ, "NCCL_SOCKET_IFNAME": "hsn0"})
    assert bool(lines) == warns
    if warns:
        assert 'warning: GLOO_SOCKET_IFNAME is not set; the frontier preset sets hsn0 (eval "$(clustertrain env ' \
               'c.yaml)" in an salloc shell sets them all)' in lines
        assert not any("NCCL_SOCKET_IFNAME" in line for line in lines)
