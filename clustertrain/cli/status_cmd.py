"""`clustertrain status RUN_DIR`: where a run stands, from its files alone (a login node will do, no torch).

    clustertrain status runs/llama-8b          # state, each rank's heartbeat, the slowest rank, a hang's stacks, jobs
    clustertrain status runs/llama-8b --json   # the same as one JSON object

The state is status.json's; the ranks are the watchdog's heartbeats (heartbeats/rank-NNNNN.json); a hang's report
and stacks are in hang/; the Slurm jobs are the chain that `clustertrain slurm status` shows (slurm/jobs.jsonl).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path
from typing import Any

from clustertrain.cli.slurm_cmd import job_table
from clustertrain.distributed.watchdog import STALE_BEATS
from clustertrain.run_dir import RunDir

DEFAULT_PERIOD_S = 10.0  # a heartbeat that does not say its period (period_s)
SHOWN_RANKS = 16  # more ranks than this: the table shows the slowest of them (--json has all)
STACK_LINES = 8  # the innermost lines of the main thread's stack shown per rank


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("status", help="a run's state, each rank's heartbeat, the slowest rank, a hang's "
                                 "stacks and its Slurm jobs' retries", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run directory (train.run_dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    report = run_report(args.run_dir)
    if args.json:
        print(json.dumps(report, indent=1, default=str))
        return 0
    # Paths stay whole, for copy and paste; no markup: the files' own text (an error, a stack) is shown as it is.
    console = Console(highlight=False, soft_wrap=True, markup=False)
    for item in format_report(report):
        console.print(item)
    return 0


# ---- gather -------------------------------------------------------------------------------------------------
def run_report(run_dir: Path, now: float | None = None) -> dict[str, Any]:
    """Everything `status` shows, as plain data (what --json prints).

    Raises:
        DataError: `run_dir` is missing or holds none of a run's files; the job chain is malformed.
    """
    from clustertrain.errors import DataError
    from clustertrain.launch.jobs import excluded_nodes, job_rows, read_chain, restarts, start_retries
    from clustertrain.train.status import read_status

    run = RunDir(run_dir)
    if not run_dir.is_dir():
        raise DataError(f"{run_dir}: {'not a directory' if run_dir.exists() else 'no such directory'}; give a run "
                        "directory (train.run_dir)")
    if not any(p.exists() for p in (run.status, run.heartbeats, run.job_chain, run.checkpoints, run.config)):
        raise DataError(f"{run_dir} is not a run directory: it has no status.json, heartbeats/, slurm/jobs.jsonl, "
                        "checkpoints/ or config.yaml")
    now = time.time() if now is None else now
    ranks, unreadable = read_heartbeats(run, now)
    chain = read_chain(run_dir)
    return {
        "run_dir": str(run_dir.resolve()),
        "time": now,
        "status": read_status(run_dir),
        "ranks": ranks,
        "unreadable_heartbeats": unreadable,
        "slowest": slowest_rank(ranks),
        "hang": read_hang(run),
        "jobs": {"restarts": restarts(chain), "start_retries": start_retries(chain),
                 "excluded": excluded_nodes(chain), "chain": job_rows(chain)} if chain else None,
    }


def read_heartbeats(run: RunDir, now: float) -> tuple[list[dict[str, Any]], list[str]]:
    """Each rank's last heartbeat, by rank, with its age (`age_s`), the time in its phase (`in_phase_s`) and whether
    it is stale (a running rank's beat older than STALE_BEATS periods: a hung or ended rank beats no more); and the
    names of the heartbeat files that cannot be read."""
    beats, unreadable = [], []
    for path in sorted(run.heartbeats.glob("rank-*.json")):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            beat = None
        if not isinstance(beat, dict) or type(beat.get("rank")) is not int:
            unreadable.append(path.name)
            continue
        period = _number(beat.get("period_s")) or DEFAULT_PERIOD_S
        beat_time = _number(beat.get("time"))
        age = None if beat_time is None else max(0.0, now - beat_time)
        started = _number(beat.get("phase_started"))
        stale = beat.get("state") == "running" and (age is None or age > STALE_BEATS * period)
        beats.append({**beat, "age_s": age, "stale": stale,
                      "in_phase_s": None if started is None else max(0.0, now - started)})
    return sorted(beats, key=lambda b: b["rank"]), unreadable


def slowest_rank(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rank at the lowest step, of those the oldest beat (a rank with no step yet is lowest)."""
    if not ranks:
        return None
    return min(ranks, key=lambda b: (_step(b), -(b["age_s"] if b["age_s"] is not None else math.inf)))


def read_hang(run: RunDir) -> dict[str, Any] | None:
    """The watchdog's hang report (hang/report.json) and the innermost lines of each rank's main-thread stack; None
    if there was no hang."""
    try:
        report = json.loads(run.hang_report.read_text())
    except (OSError, ValueError, RecursionError):
        report = None
    report = report if isinstance(report, dict) else None
    named = report.get("stacks") if report else None
    if isinstance(named, list):
        files = [run.hang / Path(n).name for n in named if isinstance(n, str)]  # names inside hang/ only
    else:
        files = sorted(run.hang.glob("rank-*.txt"))
    if report is None and not files:
        return None
    stacks = {}
    for path in files:
        try:
            stacks[path.name] = main_thread(path.read_text(errors="replace"))
        except OSError:
            stacks[path.name] = {"why": "unreadable", "thread": None, "lines": [], "more": 0}
    return {"report": report, "stacks": stacks}


def main_thread(text: str, count: int = STACK_LINES) -> dict[str, Any]:
    """The innermost `count` lines of the main thread's stack in a watchdog's dump: a first line saying why, then
    each thread ("Thread NAME (most recent call last):"), the main thread first."""
    why, _, rest = text.partition("\n")
    blocks = re.split(r"^(?=Thread .*\(most recent call last\):$)", rest, flags=re.MULTILINE)
    first = next((b for b in blocks if b.startswith("Thread ")), None)
    thread, _, body = first.partition("\n") if first else ("", "", rest)  # no thread header: the text as it is
    lines = [line for line in body.splitlines() if line.strip()]
    return {"why": why or None, "thread": thread or None, "lines": lines[-count:], "more": max(0, len(lines) - count)}


# ---- show ---------------------------------------------------------------------------------------------------
def format_report(report: dict[str, Any]) -> list[Any]:
    """The report as lines of text, and the job chain as `slurm status`'s table."""
    out = [f"run       {report['run_dir']}"]
    status = report["status"]
    out.append(f"state     {_state_line(status, report['time']) if status else 'no status.json yet (not started)'}")
    ranks = report["ranks"]
    if ranks:
        out.append(f"ranks     {len(ranks)} heartbeat(s)" + (f", the {SHOWN_RANKS} slowest shown (--json: all)"
                                                           if len(ranks) > SHOWN_RANKS else ""))
        shown = sorted(ranks, key=lambda b: (_step(b), b["rank"]))[:SHOWN_RANKS] if len(ranks) > SHOWN_RANKS else ranks
        out += _rank_table(shown)
        slow = report["slowest"]
        out.append(f"slowest   rank {slow['rank']} on {slow.get('host', '?')}: step {_show(slow.get('step'))}, "
                   f"phase {slow.get('phase') or '?'}, {_beat_age(slow)}")
    else:
        out.append("ranks     no heartbeats (the watchdog writes them while a run trains)")
    if report["unreadable_heartbeats"]:
        out.append(f"          unreadable: {', '.join(report['unreadable_heartbeats'])}")
    if report["hang"]:
        out += _hang_lines(report["hang"], RunDir(Path(report["run_dir"])).hang, report["time"])
    jobs = report["jobs"]
    if jobs:
        out.append(f"jobs      {jobs['restarts']} restart(s), {jobs['start_retries']} failed start(s) in a row"
                   + (f", excluded {', '.join(jobs['excluded'])}" if jobs["excluded"] else ""))
        out.append(job_table(jobs["chain"]))
    return out


def _state_line(status: dict[str, Any], now: float) -> str:
    line = f"{status['state']} at step {_show(status.get('step'))}/{_show(status.get('total_steps'))}"
    if status["state"] == "hung":
        ranks, hosts = status.get("stuck_ranks"), status.get("stuck_hosts")
        line += f" in {status.get('phase') or '?'}; stuck rank(s) {_show(ranks)}"
        line += f" on {_show(hosts)}" if hosts else ""
    elif status.get("reason") or status.get("error"):  # a hang's line is shown with its stacks below
        line += f": {status.get('reason') or status.get('error')}"
    written = _number(status.get("time"))
    return line + (f" ({max(0.0, now - written):.0f} s ago)" if written is not None else "")


def _rank_table(ranks: list[dict[str, Any]]) -> list[str]:
    rows = [("rank", "host", "state", "step", "phase", "in phase", "last beat", "where")]
    for b in ranks:
        where = str(b.get("where") or "") + (" (waiting in a collective)" if b.get("waiting") is True else "")
        rows.append((str(b["rank"]), str(b.get("host", "?")), str(b.get("state", "?")), _show(b.get("step")),
                     str(b.get("phase") or "?"), _seconds(b["in_phase_s"]), _beat_age(b), where))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def _hang_lines(hang: dict[str, Any], hang_dir: Path, now: float) -> list[str]:
    report = hang["report"] or {}
    when = _number(report.get("time"))
    out = [f"hang      {report.get('line') or 'stacks in hang/ (no report.json)'}"
           + (f" ({max(0.0, now - when):.0f} s ago)" if when is not None else "")]
    stuck = report.get("stuck_ranks") if isinstance(report.get("stuck_ranks"), list) else []
    names = sorted(hang["stacks"], key=lambda n: not any(n == f"rank-{r:05d}.txt" for r in stuck if type(r) is int))
    for name in names:
        stack = hang["stacks"][name]
        out.append(f"  {hang_dir}/{name}" + (f": {stack['why']}" if stack["why"] else ""))
        out += [f"    {stack['thread']}"] if stack["thread"] else []
        out += [f"      ... {stack['more']} more line(s)"] if stack["more"] else []
        out += [f"    {line}" for line in stack["lines"]]
    return out


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _step(beat: dict[str, Any]) -> int:
    return beat["step"] if type(beat.get("step")) is int else -1


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "-"
    return "?" if value is None else str(value)


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f} s"


def _beat_age(beat: dict[str, Any]) -> str:
    if beat["age_s"] is None:
        return "no beat time"
    return f"no beat for {beat['age_s']:.0f} s" if beat["stale"] else f"{beat['age_s']:.0f} s ago"
