"""`clustertrain doctor` with real ranks: a clean run passes with its table; a rank slowed by an injected fault
(clustertrain/distributed/faults.py) is named with its host; bad input exits 2 in one line."""

from __future__ import annotations

import json
import socket

import pytest
from helpers import TINY, run_cli

pytestmark = pytest.mark.dist


def doctor(tmp_path, *args: str, fault: str | None = None):
    env = {"CLUSTERTRAIN_FAULT": fault} if fault else None
    return run_cli("doctor", "--nproc", "2", *args, *(f"--set={o}" for o in (*TINY, f"train.run_dir={tmp_path}")),
                   env=env, timeout=120)


def test_two_clean_ranks_pass_with_the_table(tmp_path):
    result = doctor(tmp_path, "--output", str(tmp_path / "doctor.json"))
    assert result.returncode == 0, result.stdout + result.stderr
    for row in ("versions", "environment", "data", "disk", "matmul", "network", "busbw"):
        assert row in result.stdout, row
    assert result.stdout.rstrip().endswith("doctor: every check passed")
    saved = json.loads((tmp_path / "doctor.json").read_text())
    assert saved["ok"] and saved["bad_hosts"] == [] and saved["ranks"] == 2


@pytest.mark.parametrize("fault, check", [("matmul@1=0.05", "matmul"), ("network@1=0.03", "network")])
def test_a_slowed_rank_is_named_with_its_host(tmp_path, fault, check):
    result = doctor(tmp_path, "--json", fault=fault)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    host = socket.gethostname()
    assert [f.split(" took")[0] for f in report["failures"]] == [f"{check}: rank 1 ({host})"], report["failures"]
    assert report["bad_hosts"] == [host]


@pytest.mark.parametrize("args, says", [(["--slow", "0.5"], "--slow 0.5: give a factor above 1"),
                                        (["missing.yaml"], "missing.yaml")])
def test_bad_input_exits_2_in_one_line(tmp_path, args, says):
    result = run_cli("doctor", *args, cwd=tmp_path)
    assert result.returncode == 2 and says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_rank_started_by_srun_on_the_presets_cluster_warns_once_per_missing_variable(tmp_path):
    from clustertrain.launch.presets import load_preset

    srun = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
            "SLURM_TASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "localhost", "SLURM_CLUSTER_NAME": "frontier",
            "NCCL_SOCKET_IFNAME": "hsn0"}
    result = run_cli("train", *(f"--set={o}" for o in (*TINY, f"train.run_dir={tmp_path}", "train.steps=1",
                                                       "slurm.preset=frontier")), env=srun, timeout=120)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == len(load_preset("frontier").env) - 1, warnings  # all but NCCL_SOCKET_IFNAME
    assert 'warning: GLOO_SOCKET_IFNAME is not set; the frontier preset sets hsn0 (eval "$(clustertrain env)" in ' \
           "an salloc shell sets them all)" in warnings
