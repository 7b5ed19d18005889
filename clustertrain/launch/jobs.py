"""A run's life on Slurm: submit, record each job in a chain, requeue until done, report.

The chain is `<run_dir>/slurm/jobs.jsonl`, one event per line: `submitted` (by `slurm submit`),
`started` and `ended` (by the job script, through `slurm job-start` / `slurm job-end`). Restarts are
the `started` events after the last `submitted`, so Slurm's own requeues (node failure, preemption)
count as well as ours.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clustertrain.config.load import dump_config
from clustertrain.config.schema import RunConfig
from clustertrain.data.readers import BadData, parse_object
from clustertrain.errors import DataError, LaunchError
from clustertrain.launch.slurm import render_script
from clustertrain.distributed.stop import REQUEUE_EXIT_CODE
from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import json_value
from clustertrain.train.status import read_status

ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


def record(run_dir: Path, event: str, **fields: Any) -> dict[str, Any]:
    """Append one event to the run's job chain."""
    entry = {"event": event, "time": time.time(), **fields}
    path = RunDir(run_dir).job_chain
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


# The type of each field an event may have, as record() writes them; "event" and "job_id" are in every event.
_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    **{key: ((str,), "string") for key in ("event", "job_id", "next_job", "outcome", "script")},
    "nodes": ((str, type(None)), "string or null"), "time": ((int, float), "number"),
    "restart": ((int,), "whole number"), "exit_code": ((int,), "whole number"), "signalled": ((bool,), "boolean"),
}


def read_chain(run_dir: Path) -> list[dict[str, Any]]:
    """Every event of the run's job chain, oldest first.

    Raises:
        DataError: One line naming the file and line that is not UTF-8, not a JSON object, lacks "event" or
            "job_id", or has a field of another type than clustertrain writes.
    """
    path = RunDir(run_dir).job_chain
    if not path.exists():
        return []
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    chain = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not UTF-8 text (byte {line[e.start]:#04x} at column {e.start + 1})") from None
        event = parse_object(text, where, BadData("error"))
        for key in ("event", "job_id"):
            if key not in event:
                raise DataError(f"{where}: no {key!r}; every event of the Slurm job chain names its event and job")
        for key, (types, want) in _FIELD_TYPES.items():
            value = event.get(key)
            if key in event and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
                raise DataError(f"{where}: {key!r} is {json_value(value)}; it must be a {want}")
        chain.append(event)
    return chain


def restarts(chain: list[dict[str, Any]]) -> int:
    """How often the current submission has started again after its first start."""
    last_submit = max((i for i, e in enumerate(chain) if e["event"] == "submitted"), default=-1)
    return max(0, sum(e["event"] == "started" for e in chain[last_submit + 1:]) - 1)


# ---- submit -----------------------------------------------------------------------------------------
def submit(config: RunConfig, workdir: Path, source: str) -> tuple[str, Path]:
    """Write the config snapshot and job script into the run directory and sbatch it; returns (job id, script)."""
    sbatch = _tool("sbatch")
    run_dir = (workdir / config.run_dir).resolve()
    active = [j for j, state in job_states(job_ids(read_chain(run_dir))).items() if state in ACTIVE_STATES]
    if active:
        raise LaunchError(f"{run_dir} already has job {active[-1]} queued or running; scancel it or wait for it")
    config = config.updated(train={"resume": "auto"})  # every restart continues from the newest checkpoint
    run = RunDir(run_dir)
    snapshot = run.write(run.slurm_config, dump_config(config))
    script = run.write(run.job_script, render_script(config, [str(snapshot)], workdir, source))
    mode = script.stat().st_mode
    script.chmod(mode | (mode & 0o444) >> 2)  # executable by whoever may read it, as the umask says
    result = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, cwd=workdir)
    if result.returncode != 0:
        raise LaunchError(f"sbatch refused {script}: {' '.join(result.stderr.split())}")
    job_id = result.stdout.strip().split(";")[0]
    record(run_dir, "submitted", job_id=job_id, script=str(script))
    return job_id, script


# ---- inside the job ---------------------------------------------------------------------------------
def job_start(run_dir: Path, max_restarts: int, env: Mapping[str, str] = os.environ) -> int:
    """Record this job's start; refuse (exit 1) once the submission has restarted more than `max_restarts` times."""
    job = env.get("SLURM_JOB_ID", "?")
    restart = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    record(run_dir, "started", job_id=job, restart=restart, nodes=env.get("SLURM_JOB_NODELIST"))
    count = restarts(read_chain(run_dir))
    if count > max_restarts:
        print(f"clustertrain: not starting: this submission has restarted {count} times "
              f"(slurm.max_restarts = {max_restarts}); look at the logs, then submit again", flush=True)
        record(run_dir, "ended", job_id=job, restart=restart, exit_code=1, outcome="gave-up")
        return 1
    print(f"clustertrain: job {job} (restart {count}) on {env.get('SLURM_JOB_NODELIST', '?')}", flush=True)
    return 0


@dataclass(frozen=True)
class Decision:
    outcome: str  # finished | requeue | gave-up | stopped | failed
    message: str


def decide(status: dict[str, Any] | None, exit_code: int, signalled: bool, job_id: str, restart: int,
           restarts_so_far: int, max_restarts: int, on_stop: str) -> Decision:
    """What a job does at its end, from the run's status, the training step's exit code and Slurm's warning.

    A run is requeued when it saved and stopped on purpose (status `preempted`, exit 75), or when Slurm
    warned the job and the run neither finished nor failed with an error of its own (the warning can
    come before the ranks listen for it).
    """
    mine = bool(status) and status.get("slurm_job_id") == job_id and status.get("slurm_restart", 0) == restart
    state = status.get("state") if mine else None
    if state == "finished":
        return Decision("finished", f"the run finished at step {status.get('step')}")
    if state == "stopped" and exit_code == 0:
        return Decision("stopped", f"stopped at step {status.get('step')} as train.stop_after_steps asks; "
                                   "not requeued")
    if state == "preempted" or exit_code == REQUEUE_EXIT_CODE or (signalled and state != "failed"):
        why = (f"stopped by {status.get('reason')} at step {status.get('step')}" if state == "preempted"
               else "stopped by Slurm's warning signal")
        if on_stop == "none":
            return Decision("stopped", f"{why}; not requeued (slurm.requeue: none)")
        if restarts_so_far >= max_restarts:
            return Decision("gave-up", f"{why}; not requeued: {restarts_so_far} restarts reached "
                                       f"slurm.max_restarts = {max_restarts}")
        return Decision("requeue", f"{why}; requeue {restarts_so_far + 1} of at most {max_restarts}")
    error = status.get("error") if mine and state == "failed" else None
    return Decision("failed", f"training failed with exit code {exit_code}"
                              + (f": {error}" if error else "") + "; not requeued")


def job_end(run_dir: Path, exit_code: int, signalled: bool, on_stop: str, max_restarts: int,
            env: Mapping[str, str] = os.environ) -> int:
    """Decide, record and act at the end of a job; returns the batch script's exit code."""
    job = env.get("SLURM_JOB_ID", "?")
    restart = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    chain = read_chain(run_dir)
    decision = decide(read_status(run_dir), exit_code, signalled, job, restart, restarts(chain), max_restarts, on_stop)
    print(f"clustertrain: job {job}: {decision.message}", flush=True)
    fields = dict(job_id=job, restart=restart, exit_code=exit_code, signalled=signalled)
    if decision.outcome != "requeue":
        record(run_dir, "ended", **fields, outcome=decision.outcome)
        if decision.outcome == "finished":
            return 0
        return exit_code if decision.outcome == "stopped" else (exit_code or 1)
    if on_stop == "requeue":
        # Recorded first: `scontrol requeue` sends this very process SIGTERM.
        record(run_dir, "ended", **fields, outcome="requeued")
        result = subprocess.run([_tool("scontrol"), "requeue", job], capture_output=True, text=True)
        if result.returncode == 0:
            return 0
        print(f"clustertrain: scontrol requeue failed ({' '.join(result.stderr.split())}); "
              "submitting a follow-up job instead", flush=True)
    next_job = _submit_follow_up(job)
    record(run_dir, "ended", **fields, outcome="resubmitted", next_job=next_job)
    print(f"clustertrain: submitted follow-up job {next_job} (after {job})", flush=True)
    return 0


def _submit_follow_up(job: str) -> str:
    """sbatch the job's own script again, to start once this job has ended."""
    shown = subprocess.run([_tool("scontrol"), "show", "job", "-o", job], capture_output=True, text=True)
    script = re.search(r"\bCommand=(\S+)", shown.stdout)
    if not script:
        raise LaunchError(f"cannot find the script of job {job} to submit it again (scontrol show job {job})")
    result = subprocess.run([_tool("sbatch"), "--parsable", f"--dependency=afterany:{job}", script[1]],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise LaunchError(f"sbatch of the follow-up job failed: {' '.join(result.stderr.split())}")
    return result.stdout.strip().split(";")[0]


# ---- status -----------------------------------------------------------------------------------------
def job_states(job_ids: list[str]) -> dict[str, str]:
    """Slurm's state of each job it still knows (squeue), e.g. {'12': 'RUNNING'}."""
    squeue = shutil.which("squeue")
    if not job_ids or squeue is None:
        return {}
    result = subprocess.run([squeue, "-h", "-j", ",".join(job_ids), "-o", "%i %T"], capture_output=True, text=True)
    return dict(line.split(None, 1) for line in result.stdout.splitlines() if line.strip())


def job_ids(chain: list[dict[str, Any]]) -> list[str]:
    ids: list[str] = []
    for event in chain:
        for key in ("job_id", "next_job"):
            if event.get(key) and event[key] not in ids:
                ids.append(event[key])
    return ids


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LaunchError(f"{name} is not on PATH: run this on a Slurm login node (or `clustertrain slurm render` "
                          "to get the script)")
    return path
