"""A run's life on Slurm: submit, record each job in a chain, requeue until done, report.

The chain is `<run_dir>/slurm/jobs.jsonl`, one event per line: `submitted` (by `slurm submit`),
`started` and `ended` (by the job script, through `slurm job-start` / `slurm job-end`). Restarts are
the `started` events after the last `submitted`, so Slurm's own requeues (node failure, preemption)
count as well as ours. A job whose run failed before its first step is `retried` (slurm.max_start_retries in a
row), without the nodes `clustertrain doctor` or the hang watchdog named where the partition can spare them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clustertrain.config.load import dump_config
from clustertrain.config.schema import RunConfig
from clustertrain.distributed.env import expand_hostlist
from clustertrain.errors import ExitCode, LaunchError, one_line
from clustertrain.files import append_jsonl, json_value, read_jsonl
from clustertrain.launch.slurm import render_script
from clustertrain.run_dir import RunDir
from clustertrain.train.status import read_status

ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}
SQUEUE_TIMEOUT_S = 10.0  # squeue retries an unreachable controller for about 9 s, then fails
SLURM_JOB_ID = re.compile(r"[0-9]{1,20}(?:[_+][0-9]{1,10})?")
CHAIN_LIMIT = 16 << 20  # bytes of jobs.jsonl: some 80,000 events, far past any chain's restarts


def record(run: RunDir, event: str, **fields: Any) -> dict[str, Any]:
    """Append one event to the run's job chain."""
    entry = {"event": event, "time": time.time(), **fields}
    append_jsonl(run.job_chain, entry)
    return entry


# The type of each field an event may have, as record() writes them; "event" and "job_id" are in every event.
_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    **{key: ((str,), "string") for key in ("event", "job_id", "next_job", "outcome", "script", "excluded")},
    "nodes": ((str, type(None)), "string or null"), "time": ((int, float), "number"),
    "restart": ((int,), "whole number"), "exit_code": ((int,), "whole number"), "signalled": ((bool,), "boolean"),
}


def read_chain(run: RunDir) -> list[dict[str, Any]]:
    """Every event of the run's job chain, oldest first.

    Raises:
        DataError: One line naming the file and line that is not UTF-8, not a JSON object, lacks "event" or
            "job_id", or has a field of another type than clustertrain writes.
    """
    if not run.job_chain.exists():  # no job yet; a FIFO, a device or a file too large is named, never blocking
        return []
    return read_jsonl(run.job_chain, CHAIN_LIMIT, CHAIN_LIMIT, check=_check_event)


def _check_event(event: dict[str, Any]) -> None:
    for key in ("event", "job_id"):
        if key not in event:
            raise ValueError(f"no {key!r}; every event of the Slurm job chain names its event and job")
    for key, (types, want) in _FIELD_TYPES.items():
        value = event.get(key)
        if key in event and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise ValueError(f"{key!r} is {json_value(value)}; it must be a {want}")


def restarts(chain: list[dict[str, Any]]) -> int:
    """How often the current submission has started again after its first start."""
    last_submit = max((i for i, e in enumerate(chain) if e["event"] == "submitted"), default=-1)
    return max(0, sum(e["event"] == "started" for e in chain[last_submit + 1:]) - 1)


def start_retries(chain: list[dict[str, Any]]) -> int:
    """How many jobs of the current submission in a row, up to the last one that ended, failed before their run's
    first step and were retried."""
    count = 0
    for event in reversed(chain):
        if event["event"] == "submitted" or (event["event"] == "ended" and event.get("outcome") != "retried"):
            break
        count += event["event"] == "ended"
    return count


def excluded_nodes(chain: list[dict[str, Any]]) -> list[str]:
    """The nodes the current submission's jobs were kept off, in the order they were excluded."""
    last_submit = max((i for i, e in enumerate(chain) if e["event"] == "submitted"), default=-1)
    nodes = [n for e in chain[last_submit + 1:] if e.get("excluded") for n in e["excluded"].split(",")]
    return list(dict.fromkeys(nodes))


# ---- submit -----------------------------------------------------------------------------------------
def submit(config: RunConfig, workdir: Path, source: str) -> tuple[str, Path]:
    """Write the config snapshot and job script into the run directory and sbatch it; returns (job id, script)."""
    sbatch = _tool("sbatch")
    run = RunDir((workdir / config.run_dir).resolve())
    active = [j for j, state in job_states(job_ids(read_chain(run))).items() if state in ACTIVE_STATES]
    if active:
        raise LaunchError(f"{run.root} already has job {active[-1]} queued or running; scancel it or wait for it")
    config = config.updated(train={"resume": "auto"})  # every restart continues from the newest checkpoint
    snapshot = run.write(run.slurm_config, dump_config(config))
    script = run.write(run.job_script, render_script(config, [str(snapshot)], workdir, source))
    mode = script.stat().st_mode
    script.chmod(mode | (mode & 0o444) >> 2)  # executable by whoever may read it, as the umask says
    result = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, cwd=workdir)
    if result.returncode != 0:
        raise LaunchError(f"sbatch refused {script}: {one_line(result.stderr)}")
    job_id = result.stdout.strip().split(";")[0]
    record(run, "submitted", job_id=job_id, script=str(script))
    return job_id, script


# ---- inside the job ---------------------------------------------------------------------------------
def job_start(run: RunDir, max_restarts: int, env: Mapping[str, str] = os.environ) -> int:
    """Record this job's start; refuse (exit 1) once the submission has restarted more than `max_restarts` times."""
    job = env.get("SLURM_JOB_ID", "?")
    restart = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    record(run, "started", job_id=job, restart=restart, nodes=env.get("SLURM_JOB_NODELIST"))
    run.user_error_note.unlink(missing_ok=True)  # an earlier job's
    count = restarts(read_chain(run))
    if count > max_restarts:
        print(f"clustertrain: not starting: this submission has restarted {count} times "
              f"(slurm.max_restarts = {max_restarts}); look at the logs, then submit again", flush=True)
        record(run, "ended", job_id=job, restart=restart, exit_code=ExitCode.FAILED, outcome="gave-up")
        return ExitCode.FAILED
    print(f"clustertrain: job {job} (restart {count}) on {env.get('SLURM_JOB_NODELIST', '?')}", flush=True)
    return ExitCode.OK


@dataclass(frozen=True)
class Decision:
    outcome: str  # finished | requeue | retry | gave-up | stopped | failed
    message: str
    exclude: tuple[str, ...] = ()  # hosts to keep the next start off (a retry, or a requeue after a hang)
    named_by: str = ""  # who named them, for the job log


def decide(status: dict[str, Any] | None, exit_code: int, signalled: bool, job_id: str, restart: int,
           restarts_so_far: int, max_restarts: int, on_stop: str, *, start_retries: int = 0,
           max_start_retries: int = 0, bad_hosts: Sequence[str] = (), user_error: str | None = None) -> Decision:
    """What a job does at its end, from the run's status, the training step's exit code and Slurm's warning.

    A run is requeued when it saved and stopped on purpose (status `preempted`, exit 75), when the watchdog
    ended it for a hang (status `hung`: without its stuck hosts), or when Slurm warned the job and the run
    neither finished nor failed with an error of its own (the warning can come before the ranks listen for it).
    A job that failed before its run started (no status.json of this job, or one that says `before_start`; any
    exit code but the user's 2) is
    retried, `max_start_retries` times in a row at most, without the hosts `clustertrain doctor` named
    (`bad_hosts`). Requeues and retries both count against `max_restarts`. A `user_error` a rank noted (a
    missing file, a bad value) fails the job whatever its exit code.
    """
    mine = bool(status) and status.get("slurm_job_id") == job_id and status.get("slurm_restart", 0) == restart
    state = status.get("state") if mine else None
    if state == "finished":
        return Decision("finished", f"the run finished at step {status.get('step')}")
    if user_error:
        return Decision("failed", f"training failed with exit code {exit_code}: {user_error}; not requeued")
    if state == "stopped" and exit_code == 0:
        return Decision("stopped", f"stopped at step {status.get('step')} as train.stop_after_steps asks; "
                                   "not requeued")
    exclude, named_by, retry = (), "", False
    if state == "hung" or (exit_code == ExitCode.HUNG and not mine):  # the watchdog's exit, its report lost
        why = (f"the run hung at step {status.get('step')}" + (f" ({status['error']})" if status.get("error") else "")
               if state == "hung" else f"the watchdog ended a hang (exit code {ExitCode.HUNG})")
        exclude, named_by = _hosts(status.get("stuck_hosts") if mine else None, bad_hosts), "the hang watchdog"
    elif state == "preempted":
        why = f"stopped by {status.get('reason')} at step {status.get('step')}"
    elif exit_code == ExitCode.REQUEUE or (signalled and state != "failed"):
        why = "stopped by Slurm's warning signal"
    elif ((not mine or (state == "failed" and status.get("before_start")))
          and exit_code not in (ExitCode.OK, ExitCode.USER_ERROR) and max_start_retries > 0):
        why = f"the run failed before its first step (exit code {exit_code}" + (
            f": {status['error']})" if mine and status.get("error") else ", no status.json of this job)")
        exclude, named_by, retry = _hosts(bad_hosts), "clustertrain doctor", True
    else:
        error = status.get("error") if mine and state == "failed" else None
        return Decision("failed", f"training failed with exit code {exit_code}"
                                  + (f": {error}" if error else "") + "; not requeued")
    if on_stop == "none":
        return Decision("stopped", f"{why}; not requeued (slurm.requeue: none)")
    if retry and start_retries >= max_start_retries:
        return Decision("gave-up", f"{why}; not retried: {start_retries} failed start(s) in a row reached "
                                   f"slurm.max_start_retries = {max_start_retries}")
    if restarts_so_far >= max_restarts:
        return Decision("gave-up", f"{why}; not requeued: {restarts_so_far} restarts reached "
                                   f"slurm.max_restarts = {max_restarts}")
    if retry:
        return Decision("retry", f"{why}; retry {start_retries + 1} of at most {max_start_retries} "
                                 "(slurm.max_start_retries)", exclude, named_by)
    return Decision("requeue", f"{why}; requeue {restarts_so_far + 1} of at most {max_restarts}", exclude, named_by)


def _user_error(run: RunDir) -> str | None:
    """The user error a rank of this job noted (errors.note_user_error), if any."""
    try:
        return run.user_error_note.read_text().strip() or "a user error"
    except (OSError, UnicodeDecodeError):
        return None


def _hosts(*lists: Any) -> tuple[str, ...]:
    """The host names in `lists`, each once; whatever is not a list of names counts as none."""
    names = [h for hosts in lists if isinstance(hosts, (list, tuple)) for h in hosts if isinstance(h, str) and h]
    return tuple(dict.fromkeys(names))


def doctor_bad_hosts(run: RunDir) -> list[str]:
    """The hosts `clustertrain doctor` found bad during this job, from <run_dir>/doctor.json: only a report
    written since the job's `started` event (the last write to the chain before job-end), so an earlier job's
    findings exclude nothing. Both times are the file system's, so the nodes' clocks do not matter."""
    try:
        if run.doctor.stat().st_mtime < run.job_chain.stat().st_mtime:
            return []
        report = json.loads(run.doctor.read_text())
    except (OSError, ValueError, RecursionError):
        return []
    return list(_hosts(report.get("bad_hosts") if isinstance(report, dict) else None))


def job_end(run: RunDir, exit_code: int, signalled: bool, on_stop: str, max_restarts: int,
            max_start_retries: int = 0, env: Mapping[str, str] = os.environ) -> int:
    """Decide, record and act at the end of a job; returns the batch script's exit code."""
    job = env.get("SLURM_JOB_ID", "?")
    restart = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    chain = read_chain(run)
    decision = decide(read_status(run), exit_code, signalled, job, restart, restarts(chain), max_restarts,
                      on_stop, start_retries=start_retries(chain), max_start_retries=max_start_retries,
                      bad_hosts=doctor_bad_hosts(run), user_error=_user_error(run))
    print(f"clustertrain: job {job}: {decision.message}", flush=True)
    fields: dict[str, Any] = dict(job_id=job, restart=restart, exit_code=exit_code, signalled=signalled)
    if decision.outcome not in ("requeue", "retry"):
        record(run, "ended", **fields, outcome=decision.outcome)
        if decision.outcome == "finished":
            return ExitCode.OK
        return exit_code if decision.outcome == "stopped" else (exit_code or ExitCode.FAILED)
    exclude = _exclusion(job, decision.exclude, decision.named_by) if decision.exclude else []
    if exclude:
        fields["excluded"] = ",".join(exclude)
    outcome = "retried" if decision.outcome == "retry" else "requeued"
    if on_stop == "requeue":
        # `scontrol requeue` sends this very process (and its children) SIGTERM: ignored, so that the exclusion,
        # which Slurm takes only once the job is no longer running, and the record still happen. The job cannot
        # start again before this process has exited.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        result = subprocess.run([_tool("scontrol"), "requeue", job], capture_output=True, text=True)
        if result.returncode == 0:
            if exclude and not _update_exclusion(job, exclude):
                del fields["excluded"]
            record(run, "ended", **fields, outcome=outcome)
            return ExitCode.OK
        print(f"clustertrain: scontrol requeue failed ({one_line(result.stderr)}); "
              "submitting a follow-up job instead", flush=True)
    next_job = _submit_follow_up(job, exclude)
    record(run, "ended", **fields, outcome="resubmitted" if outcome == "requeued" else outcome, next_job=next_job)
    print(f"clustertrain: submitted follow-up job {next_job} (after {job})", flush=True)
    return ExitCode.OK


def _exclusion(job: str, hosts: Sequence[str], named_by: str) -> list[str]:
    """The nodes job `job`'s next start must avoid: those it already avoids, and those of `hosts` that are nodes
    of its partition (a host name or its short form), unless the partition would then have too few nodes left
    for the job (Slurm would keep it pending for ever). Says in the job log what it does."""
    shown = subprocess.run([_tool("scontrol"), "show", "job", "-o", job], capture_output=True, text=True).stdout
    fields = dict(re.findall(r"(\w+)=(\S*)", shown))
    partition, needed = fields.get("Partition", ""), int(re.match(r"\d*", fields.get("NumNodes", "")).group() or 1)
    sinfo = shutil.which("sinfo")  # without it no node is known, so none is excluded: the requeue goes on
    listed = sinfo and subprocess.run([sinfo, "-h", "-N", "-p", partition, "-o", "%N"], capture_output=True, text=True)
    nodes = set(listed.stdout.split()) if listed and listed.returncode == 0 else set()
    try:
        current = [] if fields.get("ExcNodeList", "(null)") == "(null)" else expand_hostlist(fields["ExcNodeList"])
    except LaunchError:
        current = []
    named = [h if h in nodes else h.split(".")[0] for h in hosts]
    new = [n for n in dict.fromkeys(named) if n in nodes and n not in current]
    say = f"clustertrain: job {job}:"
    if unknown := [h for h, n in zip(hosts, named) if n not in nodes]:
        print(f"{say} not excluding {', '.join(unknown)} (named by {named_by}): not a node of partition "
              f"{partition or '?'}", flush=True)
    if not new:
        return current
    left = len(nodes - set(current) - set(new))
    if left < needed:
        print(f"{say} not excluding {', '.join(new)} (named by {named_by}): partition {partition} would keep "
              f"{left} node(s) for a job of {needed}", flush=True)
        return current
    print(f"{say} excluding {', '.join(new)} (named by {named_by}) from the next start", flush=True)
    return current + new


def _update_exclusion(job: str, nodes: list[str]) -> bool:
    """Keep the requeued job `job` off `nodes` (Slurm takes ExcNodeList only from a job that is not running)."""
    result = subprocess.run([_tool("scontrol"), "update", f"JobId={job}", f"ExcNodeList={','.join(nodes)}"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        print(f"clustertrain: job {job}: Slurm refused to exclude {','.join(nodes)} "
              f"({one_line(result.stderr or result.stdout)}); requeued without excluding them", flush=True)
    return result.returncode == 0


def _submit_follow_up(job: str, exclude: list[str]) -> str:
    """sbatch the job's own script again, to start once this job has ended (off the nodes in `exclude`)."""
    shown = subprocess.run([_tool("scontrol"), "show", "job", "-o", job], capture_output=True, text=True)
    script = re.search(r"\bCommand=(\S+)", shown.stdout)
    if not script:
        raise LaunchError(f"cannot find the script of job {job} to submit it again (scontrol show job {job})")
    options = [f"--exclude={','.join(exclude)}"] if exclude else []
    result = subprocess.run([_tool("sbatch"), "--parsable", f"--dependency=afterany:{job}", *options, script[1]],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise LaunchError(f"sbatch of the follow-up job failed: {one_line(result.stderr)}")
    return result.stdout.strip().split(";")[0]


# ---- status -----------------------------------------------------------------------------------------
def job_states(job_ids: list[str]) -> dict[str, str]:
    """Slurm's state of each job it still knows (squeue), e.g. {'12': 'RUNNING'}. Only ids Slurm could have given
    (`123`, an array's `123_4`, a het job's `123+0`) are asked about: a tampered chain's id is no argument to it."""
    squeue = shutil.which("squeue")
    job_ids = [j for j in job_ids if SLURM_JOB_ID.fullmatch(j)]
    if not job_ids or squeue is None:
        return {}
    try:
        result = subprocess.run([squeue, "-h", "-j", ",".join(job_ids), "-o", "%i %T"], capture_output=True,
                                text=True, timeout=SQUEUE_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # a controller down or swamped: the recorded outcomes stand
        return {}
    return dict(line.split(None, 1) for line in result.stdout.splitlines() if line.strip())


def job_rows(chain: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per start of each job of the chain (a job not started yet: one row): job, restart, state (Slurm's,
    for the newest start of a job squeue still knows, else the recorded outcome), started and ended (times), exit
    code, nodes, and the nodes excluded from the next start."""
    rows = []
    live = job_states(job_ids(chain))
    for job_id in job_ids(chain):
        events = [e for e in chain if e.get("job_id") == job_id]
        starts = [e for e in events if e["event"] == "started"] or [{}]
        ends = [e for e in events if e["event"] == "ended"]
        for i, start in enumerate(starts):
            end = ends[i] if i < len(ends) else {}
            state = live.get(job_id) if i == len(starts) - 1 and job_id in live else end.get("outcome", "?")
            rows.append({"job": job_id, "restart": start.get("restart", "-"), "state": state,
                         "started": start.get("time"), "ended": end.get("time"), "exit_code": end.get("exit_code"),
                         "nodes": start.get("nodes"), "excluded": end.get("excluded")})
    return rows


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
