"""Real Slurm: a scaling study (`slurm submit --scaling 1,2`, one rank per node on the two emulated nodes) renders
one job per node count, runs them, and its report turns their metrics into a table and a PNG; and CPU ranks get
their node's cores (each emulated node has 2 CPUs) as OMP_NUM_THREADS."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from helpers import TINY, run_cli
from slurmjobs import SUBMITTED, require_slurm, wait_until_done

pytestmark = [pytest.mark.dist, pytest.mark.slurm]

SETTINGS = (*TINY, "metrics.log_every=2", "checkpoint.every=0", "train.sample_tokens=0", "slurm.tasks_per_node=1",
            "slurm.time=00:10:00", "slurm.signal_before=60")


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    """A finished scaling study at 1 and 2 nodes; every clustertrain call of its jobs logs its environment."""
    require_slurm()
    root = tmp_path_factory.mktemp("scaling")
    python = root / "python"  # slurm.python: the job's Python, behind a shell that notes what each call sees
    python.write_text(f'#!/bin/bash\necho "$3 node=$SLURMD_NODENAME rank=$SLURM_PROCID omp=$OMP_NUM_THREADS" '
                      f'>> {root}/calls.log\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    run_dir = root / "study"
    SUBMITTED.extend([run_dir / "scaling-N1", run_dir / "scaling-N2"])  # cancelled after the test if unfinished
    sets = [*SETTINGS, f"train.run_dir={run_dir}", f"slurm.python={python}"]
    result = run_cli("slurm", "submit", *[f"--set={o}" for o in sets], "--scaling", "2,1", "--steps", "16")
    assert result.returncode == 0, result.stderr
    assert [line.split()[3:5] for line in result.stdout.splitlines()[:2]] == [["1", "node(s)"], ["2", "node(s)"]]
    assert f"clustertrain slurm scaling {run_dir}" in result.stdout
    for nodes in (1, 2):
        assert wait_until_done(run_dir / f"scaling-N{nodes}") == ["finished"]
    return run_dir


def test_one_job_per_node_count_with_the_same_global_batch(study):
    for nodes in (1, 2):
        job = (study / f"scaling-N{nodes}" / "slurm" / "job.sh").read_text().splitlines()
        assert f"#SBATCH --nodes={nodes}" in job and "#SBATCH --ntasks-per-node=1" in job
        snapshot = yaml.safe_load((study / f"scaling-N{nodes}" / "slurm" / "config.yaml").read_text())
        assert (snapshot["train"]["global_batch_size"], snapshot["train"]["steps"]) == (8, 16)


def test_the_report_turns_their_metrics_into_a_table_and_a_png(study):
    plt = pytest.importorskip("matplotlib.pyplot")
    result = run_cli("slurm", "scaling", str(study))
    assert result.returncode == 0, result.stderr
    header, one, two = result.stdout.splitlines()[:3]
    assert header.split()[:4] == ["nodes", "ranks", "steps", "tokens/s"]
    assert one.split()[:3] == ["1", "1", "10"] and one.split()[-1] == "100%"  # steps 6 to 16: after the warm-up
    assert two.split()[:3] == ["2", "2", "10"] and two.split()[-1].endswith("%")
    image = plt.imread(study / "scaling.png")
    assert image.shape[:2] == (400, 1100) and image.std() > 0


def test_cpu_ranks_get_the_cores_of_their_node(study):
    calls = (study.parent / "calls.log").read_text().splitlines()
    ranks = [line for line in calls if line.startswith("train ")]
    assert len(ranks) == 3, calls  # 1 rank at 1 node, 2 ranks at 2 nodes
    assert all(line.endswith("omp=2") for line in ranks), ranks  # the node's 2 CPUs / 1 rank per node
    assert {line.split()[1] for line in ranks} == {"node=node1", "node=node2"}
