"""Submit clustertrain runs to the real local Slurm (scripts/slurm/setup_local_slurm.sh) and wait on them."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from helpers import TINY, require, run_cli

from clustertrain.launch.jobs import ACTIVE_STATES, job_ids, job_states, read_chain
from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import read_metrics

# Long enough (tens of seconds) for Slurm's warning to land mid-run; logs rarely, to keep steps cheap.
LONG = (*TINY, "metrics.log_every=50", "checkpoint.every=100")
SUBMITTED: list[Path] = []  # the run directories of this test's submissions; conftest.py cancels their jobs
FOLLOWED = ([], ["requeued"], ["resubmitted"], ["retried"])  # the last outcomes that another start follows


def require_slurm() -> None:
    require("sbatch", ["sinfo", "-h"])


def submit(run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> str:
    """`clustertrain slurm submit` of the tiny model with 2 CPU ranks on one node (sbatch passes `env` on to the
    job and srun to its ranks); returns the job id."""
    settings = (*LONG, "slurm.tasks_per_node=2", "slurm.time=00:10:00", "slurm.signal_before=60", *overrides,
                f"train.run_dir={run_dir}")
    SUBMITTED.append(run_dir)
    result = run_cli("slurm", "submit", *[f"--set={o}" for o in settings], env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()[2]


def cancel_jobs(run_dir: Path, settle_s: float = 90) -> None:
    """Cancel the run's queued and running jobs, follow-up jobs included. A cancelled job's own end can requeue
    it or submit a follow-up, so look again until the chain has ended for good or stayed quiet for 3 s."""
    deadline, quiet = time.monotonic() + settle_s, 0
    while time.monotonic() < deadline and quiet < 3:
        active = [j for j, state in job_states(job_ids(read_chain(RunDir(run_dir)))).items() if state in ACTIVE_STATES]
        if active:
            subprocess.run(["scancel", *active], capture_output=True)
            quiet = 0
        elif outcomes(run_dir)[-1:] not in FOLLOWED:
            return  # finished, failed, gave up or stopped: nothing follows
        else:
            quiet += 1
        time.sleep(1)


def log(run_dir: Path) -> str:
    """Every job log of the run, in job order."""
    return "".join(p.read_text() for p in sorted((run_dir / "slurm").glob("*.out"), key=lambda p: int(p.stem)))


def outcomes(run_dir: Path) -> list[str]:
    return [e["outcome"] for e in read_chain(RunDir(run_dir)) if e["event"] == "ended"]


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return max((r["step"] for r in read_metrics(path)), default=0) if path.exists() else 0


def wait_for(condition, run_dir: Path, what: str, timeout: float = 400) -> None:
    """Poll `condition()` until it holds; on timeout, fail with the chain, the logs and the queue."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            queue = subprocess.run(["squeue"], capture_output=True, text=True).stdout
            chain = read_chain(RunDir(run_dir))
            raise AssertionError(f"timed out waiting for {what}\nchain: {chain}\nqueue:\n{queue}\n"
                                 f"log:\n{log(run_dir)[-4000:]}")
        time.sleep(1)


def wait_until_done(run_dir: Path, timeout: float = 400) -> list[str]:
    """Wait until the run's last job has ended for good (not requeued or resubmitted); returns the outcomes."""
    wait_for(lambda: outcomes(run_dir)[-1:] not in FOLLOWED, run_dir, "the end", timeout)
    return outcomes(run_dir)


def scancel(*args: str) -> None:
    subprocess.run(["scancel", *args], check=True)
