"""`clustertrain status RUN_DIR`: where a run stands, from its files alone (a login node will do, no torch).

    clustertrain status runs/llama-8b          # state, each rank's heartbeat, the slowest rank, a hang's stacks, jobs
    clustertrain status runs/llama-8b --json   # the same as one JSON object

The state is status.json's; the ranks are the watchdog's heartbeats (heartbeats/rank-NNNNN.json); a hang's report
and stacks are in hang/; the Slurm jobs are the chain that `clustertrain slurm status` shows (slurm/jobs.jsonl).
A damaged file (not a regular file, too large, not JSON, not an object) is named with what is wrong, the rest is
still shown, and the exit code is 1; text from the files is shown without control characters, cut to a page.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path
from typing import Any

from clustertrain.cli.screen import CELL_CHARS, LINE_CHARS, cut, printable
from clustertrain.cli.slurm_cmd import job_table
from clustertrain.distributed.watchdog import STALE_BEATS
from clustertrain.files import read_json_object, read_regular
from clustertrain.run_dir import RunDir

DEFAULT_PERIOD_S = 10.0  # a heartbeat that does not say its period (period_s)
SHOWN_RANKS = 16  # more ranks (or stack files) than this: the slowest (the stuck ranks') shown; --json has all
STACK_LINES = 8  # the innermost lines of the main thread's stack shown per rank
ERROR_LINES = 12  # the lines of status.json's error shown
DAMAGED_SHOWN = 8  # damaged files named, one a line (--json has all)
STATUS = RunDir(Path()).status.name  # status.json, as `damaged` names it
CHECKPOINT = re.compile(r"step-(\d+)")  # a complete checkpoint's folder (checkpoint/dcp.py, which imports torch)


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("status", help="a run's state, each rank's heartbeat, the slowest rank, a hang's "
                                 "stacks and its Slurm jobs' retries", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=RunDir, help="the run directory (train.run_dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    report = run_report(args.run_dir)
    if args.json:  # json.dumps escapes control characters; each file read is at most files.READ_LIMIT bytes
        print(json.dumps(report, indent=1, default=str))
    else:
        # Paths stay whole, for copy and paste; no markup or emoji codes: the files' own text is shown as it is.
        console = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)
        for item in format_report(report):
            console.print(printable(item) if isinstance(item, str) else item)
    return 1 if report["damaged"] else 0


# ---- gather -------------------------------------------------------------------------------------------------
def run_report(run: RunDir, now: float | None = None) -> dict[str, Any]:
    """Everything `status` shows, as plain data (what --json prints).

    Raises:
        DataError: The run directory is missing or holds none of a run's files; the job chain cannot be read or
            is malformed.
    """
    from clustertrain.errors import DataError
    from clustertrain.launch.jobs import excluded_nodes, job_rows, read_chain, restarts, start_retries
    from clustertrain.train.status import load_status

    run_dir = run.root
    if not run_dir.is_dir():
        raise DataError(f"{run_dir}: {'not a directory' if run_dir.exists() else 'no such directory'}; give a run "
                        "directory (train.run_dir)")
    if not any(p.exists() for p in (run.status, run.heartbeats, run.job_chain, run.checkpoints, run.config)):
        raise DataError(f"{run_dir} is not a run directory: it has no status.json, heartbeats/, slurm/jobs.jsonl, "
                        "checkpoints/ or config.yaml")
    now = time.time() if now is None else now
    damaged: dict[str, str] = {}  # each run file that cannot be read (its path in the run) -> what is wrong
    try:
        status = load_status(run)
    except (OSError, ValueError) as e:
        status, damaged[run.status.name] = None, _why(e)
    ranks, unreadable = read_heartbeats(run, now)
    damaged.update({f"{run.heartbeats.name}/{name}": why for name, why in unreadable.items()})
    hang = read_hang(run, damaged)
    chain = read_chain(run)
    return {
        "run_dir": str(run_dir.resolve()),
        "time": now,
        "status": status,
        "checkpoints": checkpoint_steps(run),
        "ranks": ranks,
        "unreadable_heartbeats": sorted(unreadable),
        "damaged": damaged,
        "slowest": slowest_rank(ranks),
        "hang": hang,
        "jobs": {"restarts": restarts(chain), "start_retries": start_retries(chain),
                 "excluded": excluded_nodes(chain), "chain": job_rows(chain)} if chain else None,
    }


def read_heartbeats(run: RunDir, now: float) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Each rank's last heartbeat, by rank, with its age (`age_s`), the time in its phase (`in_phase_s`) and whether
    it is stale (a running rank's beat older than STALE_BEATS periods: a hung or ended rank beats no more); and the
    heartbeat files that cannot be read, by name, with what is wrong."""
    beats, unreadable = [], {}
    for path in sorted(run.heartbeats.glob("rank-*.json")):
        try:
            beat = read_json_object(path)
        except (OSError, ValueError) as e:
            unreadable[path.name] = _why(e)
            continue
        if type(beat.get("rank")) is not int:
            unreadable[path.name] = 'not a heartbeat (no whole-number "rank")'
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


def read_hang(run: RunDir, damaged: dict[str, str]) -> dict[str, Any] | None:
    """The watchdog's hang report (hang/report.json) and the innermost lines of each rank's main-thread stack; None
    if there was no hang. The files that cannot be read are added to `damaged`."""
    report = None
    try:
        report = read_json_object(run.hang_report)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        damaged[f"{run.hang.name}/{run.hang_report.name}"] = _why(e)
    named = report.get("stacks") if report else None
    if isinstance(named, list):
        names = dict.fromkeys(Path(n).name for n in named if isinstance(n, str))  # inside hang/ only, each once
        files = [run.hang / name for name in names if name]
    else:
        files = sorted(run.hang.glob("rank-*.txt"))
    if report is None and not files:
        return None
    stacks = {}
    for path in files:
        try:
            stacks[path.name] = main_thread(read_regular(path).decode(errors="replace"))
        except OSError as e:
            damaged[f"{run.hang.name}/{path.name}"] = _why(e)
            stacks[path.name] = {"why": f"unreadable: {_why(e)}", "thread": None, "lines": [], "more": 0}
    return {"report": report, "stacks": stacks}


def checkpoint_steps(run: RunDir) -> list[int]:
    """The steps of the run's complete checkpoints (a folder has its final name only once complete), ascending."""
    try:
        return sorted(int(m[1]) for p in run.checkpoints.iterdir() if (m := CHECKPOINT.fullmatch(p.name)))
    except OSError:  # none yet, or not a folder
        return []


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
    """The report as lines of text, and the job chain as `slurm status`'s table: each value from a run's file cut to
    LINE_CHARS (an error to ERROR_LINES lines); `run` makes the lines `printable`, `job_table` its cells."""
    run_dir = report["run_dir"]
    out = [f"run       {run_dir}"]
    status = report["status"]
    out.append(f"state     {_state_line(status, report['time']) if status else _no_status(report)}")
    out += _error_lines(status, f"{run_dir}/{STATUS}") if status else []
    ranks = report["ranks"]
    if ranks:
        out.append(f"ranks     {len(ranks)} heartbeat(s)" + (f", the {SHOWN_RANKS} slowest shown (--json: all)"
                                                           if len(ranks) > SHOWN_RANKS else ""))
        shown = sorted(ranks, key=lambda b: (_step(b), b["rank"]))[:SHOWN_RANKS] if len(ranks) > SHOWN_RANKS else ranks
        out += _rank_table(shown)
        slow = report["slowest"]
        out.append(f"slowest   rank {cut(slow['rank'])} on {cut(slow.get('host', '?'), CELL_CHARS)}: step "
                   f"{_show(slow.get('step'))}, phase {cut(slow.get('phase') or '?', CELL_CHARS)}, {_beat_age(slow)}")
    else:
        out.append("ranks     no heartbeats (the watchdog writes them while a run trains)")
    damaged = list(report["damaged"].items())
    out += [f"{'damaged' if i == 0 else '':<10}{run_dir}/{name}: {cut(why)}"
            for i, (name, why) in enumerate(damaged[:DAMAGED_SHOWN])]
    if len(damaged) > DAMAGED_SHOWN:
        out.append(f"          ... and {len(damaged) - DAMAGED_SHOWN} more (--json: all)")
    if report["hang"]:
        out += _hang_lines(report["hang"], RunDir(run_dir).hang, report["time"])
    jobs = report["jobs"]
    if jobs:
        out.append(f"jobs      {jobs['restarts']} restart(s), {jobs['start_retries']} failed start(s) in a row"
                   + (f", excluded {cut(', '.join(jobs['excluded']))}" if jobs["excluded"] else ""))
        out.append(job_table(jobs["chain"]))
    return out


def _state_line(status: dict[str, Any], now: float) -> str:
    line = f"{cut(status['state'], CELL_CHARS)} at step {_show(status.get('step'))}/{_show(status.get('total_steps'))}"
    if status["state"] == "hung":
        ranks, hosts = status.get("stuck_ranks"), status.get("stuck_hosts")
        line += f" in {cut(status.get('phase') or '?', CELL_CHARS)}; stuck rank(s) {_show(ranks)}"
        line += f" on {_show(hosts)}" if hosts else ""
    elif status.get("reason") or status.get("error"):  # a hang's line is shown with its stacks below
        said = str(status.get("reason") or status.get("error")).splitlines()
        line += f": {cut(said[0] if said else '')}"
    written = _number(status.get("time"))
    return line + (f" ({max(0.0, now - written):.0f} s ago)" if written is not None else "")


def _error_lines(status: dict[str, Any], path: str) -> list[str]:
    """The lines of a status's reason or error after its first (on the state line), at most ERROR_LINES in all."""
    said = status.get("reason") or status.get("error")
    if status["state"] == "hung" or not said:
        return []
    lines = str(said).splitlines()
    out = [f"          {cut(line)}" for line in lines[1:ERROR_LINES]]
    shortened = len(lines) > ERROR_LINES or any(len(line) > LINE_CHARS for line in lines[:ERROR_LINES])
    return out + ([f"          ... (cut; see {path})"] if shortened else [])


def _no_status(report: dict[str, Any]) -> str:
    """The state line of a run whose status.json is missing or damaged: never "not started" once it has trained."""
    steps = report["checkpoints"]
    saved = f"checkpoints up to step {steps[-1]} ({len(steps)} in all)" if steps else ""
    if STATUS in report["damaged"]:
        return f"unknown: {STATUS} is damaged (below)" + (f"; {saved}" if saved else "")
    if saved:
        return f"no {STATUS}; {saved}: the run has trained"
    return f"no {STATUS}; heartbeats: the run has started" if report["ranks"] else f"no {STATUS} yet (not started)"


def _rank_table(ranks: list[dict[str, Any]]) -> list[str]:
    rows = [("rank", "host", "state", "step", "phase", "in phase", "last beat", "where")]
    for b in ranks:
        where = cut(b.get("where") or "") + (" (waiting in a collective)" if b.get("waiting") is True else "")
        rows.append((cut(b["rank"], CELL_CHARS), cut(b.get("host", "?"), CELL_CHARS),
                     cut(b.get("state", "?"), CELL_CHARS), _show(b.get("step"), CELL_CHARS),
                     cut(b.get("phase") or "?", CELL_CHARS), _seconds(b["in_phase_s"]), _beat_age(b), where))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def _hang_lines(hang: dict[str, Any], hang_dir: Path, now: float) -> list[str]:
    report = hang["report"] or {}
    when = _number(report.get("time"))
    out = [f"hang      {cut(report.get('line') or 'stacks in hang/ (no readable report.json)')}"
           + (f" ({max(0.0, now - when):.0f} s ago)" if when is not None else "")]
    stuck = report.get("stuck_ranks") if isinstance(report.get("stuck_ranks"), list) else []
    stuck_files = {f"rank-{r:05d}.txt" for r in stuck if type(r) is int}
    names = sorted(hang["stacks"], key=lambda n: n not in stuck_files)
    for name in names[:SHOWN_RANKS]:
        stack = hang["stacks"][name]
        out.append(f"  {hang_dir}/{name}" + (f": {cut(stack['why'])}" if stack["why"] else ""))
        out += [f"    {cut(stack['thread'])}"] if stack["thread"] else []
        out += [f"      ... {stack['more']} more line(s)"] if stack["more"] else []
        out += [f"    {cut(line)}" for line in stack["lines"]]
    if len(names) > SHOWN_RANKS:
        out.append(f"  ... {len(names) - SHOWN_RANKS} more stack file(s) in {hang_dir} (--json: all)")
    return out


def _why(error: Exception) -> str:
    """What is wrong with a run's file, from files.read_regular's OSError or read_json_object's ValueError."""
    return (error.strerror or str(error)) if isinstance(error, OSError) else str(error)


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _step(beat: dict[str, Any]) -> int:
    return beat["step"] if type(beat.get("step")) is int else -1


def _show(value: Any, limit: int = LINE_CHARS) -> str:
    if isinstance(value, list):
        return cut(", ".join(map(str, value)) or "-", limit)
    return "?" if value is None else cut(value, limit)


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f} s"


def _beat_age(beat: dict[str, Any]) -> str:
    if beat["age_s"] is None:
        return "no beat time"
    return f"no beat for {beat['age_s']:.0f} s" if beat["stale"] else f"{beat['age_s']:.0f} s ago"
