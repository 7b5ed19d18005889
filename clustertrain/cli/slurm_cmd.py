"""`clustertrain slurm render|submit|status`: a run's whole life on Slurm, from one config.

    clustertrain slurm render configs/frontier-llama.yaml              # print the sbatch script
    clustertrain slurm submit configs/frontier-llama.yaml --set slurm.nodes=4
    clustertrain slurm submit configs/frontier-llama.yaml --doctor     # `clustertrain doctor` first (docs/doctor.md)
    clustertrain slurm status runs/frontier-llama                      # jobs, checkpoint, progress, ETA
    clustertrain slurm submit configs/opt-pp-lora-cpu.yaml --scaling 1,2,4,8 --steps 30  # one job per node count
    clustertrain slurm scaling runs/opt-pp-lora-cpu                    # their tokens/s, efficiency, a PNG

The script calls `slurm job-start` and `slurm job-end` itself: they record the job chain and requeue a
run that was stopped unfinished (signal, preemption, time limit) until it is done.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path
from typing import Any

from clustertrain.cli.screen import CELL_CHARS, cut, printable
from clustertrain.run_dir import RunDir


def add_parser(commands: argparse._SubParsersAction) -> None:
    slurm = commands.add_parser(
        "slurm", help="render, submit and follow Slurm jobs that run until the training is done",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = slurm.add_subparsers(dest="slurm_command", required=True, metavar="SUBCOMMAND")
    for name, run, help_text in (("render", run_render, "print (or write) the sbatch script of a config"),
                                 ("submit", run_submit, "render the script into the run directory and sbatch it")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", nargs="?", help="YAML or TOML config; omit for the embedded default")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. slurm.nodes=4")
        p.add_argument("--doctor", action="store_true", help="run `clustertrain doctor` on every rank before "
                       "training (sets slurm.doctor); a failure stops the job, its findings in <run_dir>/doctor.json")
        if name == "render":
            p.add_argument("-o", "--output", help="write the script here instead of printing it; never over the "
                           "config or preset, nor over an existing file without --force")
            p.add_argument("--force", action="store_true", help="replace the --output file if it exists")
        else:
            p.add_argument("--scaling", metavar="NODES", help="a scaling study: the same run at each of these node "
                           "counts (e.g. 1,2,4,8), each in <run_dir>/scaling-N<nodes>, with the same global batch")
            p.add_argument("--steps", type=int, help="with --scaling: steps of each run (default train.steps)")
        p.set_defaults(run=run)

    scaling = sub.add_parser("scaling", help="tokens/s and scaling efficiency of a --scaling study, as a table and PNG")
    scaling.add_argument("run_dir", type=Path, help="the run directory holding the scaling-N<nodes> runs")
    scaling.add_argument("-o", "--output", type=Path, help="the PNG to write (default RUN_DIR/scaling.png)")
    scaling.add_argument("--warmup-steps", type=int, default=5,
                         help="leave out the log intervals that start before this step (default 5)")
    scaling.set_defaults(run=run_scaling)

    status = sub.add_parser("status", help="the job chain, newest checkpoint, progress and ETA of a run")
    status.add_argument("run_dir", type=RunDir)
    status.set_defaults(run=run_status)

    start = sub.add_parser("job-start", help="(called by the job script) record the job; stop a crash loop")
    start.add_argument("run_dir", type=RunDir)
    start.add_argument("--max-restarts", type=int, required=True)
    start.set_defaults(run=lambda a: _jobs().job_start(a.run_dir, a.max_restarts))

    end = sub.add_parser("job-end", help="(called by the job script) record the outcome; requeue if unfinished")
    end.add_argument("run_dir", type=RunDir)
    end.add_argument("--exit-code", type=int, required=True)
    end.add_argument("--signalled", type=int, choices=(0, 1), default=0, help="1 if Slurm warned the job")
    end.add_argument("--on-stop", choices=("requeue", "dependency", "none"), required=True)
    end.add_argument("--max-restarts", type=int, required=True)
    end.add_argument("--max-start-retries", type=int, default=0, help="retries of a run that failed before its "
                     "first step (a script rendered before this option: none)")
    end.set_defaults(run=lambda a: _jobs().job_end(a.run_dir, a.exit_code, bool(a.signalled), a.on_stop,
                                                 a.max_restarts, a.max_start_retries))


def _jobs():
    from clustertrain.launch import jobs

    return jobs


def _load(args: argparse.Namespace):
    from clustertrain.resolve.load import load_checked_config

    if getattr(args, "doctor", False):
        args.set = [*args.set, "slurm.doctor=true"]  # the job script passes it on to the doctor and train steps

    return load_checked_config(args.config, args.set)


def run_render(args: argparse.Namespace) -> int:
    from clustertrain.launch.slurm import render_script

    config = _load(args)
    train_args = [str(Path(args.config).resolve())] if args.config else []
    train_args += [f"--set={o}" for o in args.set]
    if getattr(args, "log_level", None):  # `slurm submit` passes it on in the environment sbatch exports
        train_args += ["--log-level", args.log_level]
    script = render_script(config, train_args, Path.cwd(), args.config or "the embedded default config")
    if args.output:
        from clustertrain.cli.outputs import write_output

        write_output(args.output, script, [p for p in (args.config, config.slurm.preset) if p], args.force, "--output")
        print(f"wrote {args.output}; submit it with: sbatch {args.output}")
    else:
        sys.stdout.write(script)
    return 0


def run_submit(args: argparse.Namespace) -> int:
    from clustertrain.errors import ConfigError

    if args.scaling:
        return submit_scaling(args)
    if args.steps is not None:
        raise ConfigError("--steps goes with --scaling; for one run, use --set train.steps=N")
    config = _load(args)
    job_id, script = _jobs().submit(config, Path.cwd(), args.config or "the embedded default config")
    run_dir = script.parent.parent
    print(f"submitted job {job_id} ({script})")
    print(f"  follow:  clustertrain slurm status {run_dir}")
    print(f"  log:     tail -f {RunDir(run_dir).job_log(job_id)}")
    return 0


def submit_scaling(args: argparse.Namespace) -> int:
    from clustertrain.errors import ConfigError
    from clustertrain.launch.scaling import parse_counts, submit_scaling

    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: give a positive number of steps")
    config = _load(args)
    counts = parse_counts(args.scaling)
    submitted = submit_scaling(config, counts, args.steps, Path.cwd(), args.config or "the embedded default config")
    for nodes, job_id, script in submitted:
        print(f"submitted job {job_id}: {nodes} node(s) ({script})")
    run_dir = submitted[0][2].parent.parent.parent
    print(f"  report:  clustertrain slurm scaling {run_dir}   (once the jobs have run)")
    return 0


def run_scaling(args: argparse.Namespace) -> int:
    from clustertrain.launch.scaling import format_table, read_scaling, require_measured
    from clustertrain.train.plots import plot_scaling, pyplot

    pyplot()  # fail before reading anything when matplotlib is missing
    rows = read_scaling(args.run_dir, args.warmup_steps)
    require_measured(rows, args.run_dir, args.warmup_steps)
    print(format_table(rows))
    out = plot_scaling(rows, args.output or RunDir(args.run_dir).scaling_plot)
    print(f"wrote {out}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    """Exit 0, or 1 when status.json or metrics.jsonl is damaged (named on its line, the rest still shown)."""
    from rich.console import Console
    from rich.text import Text

    from clustertrain.checkpoint.dcp import latest_checkpoint
    from clustertrain.errors import DataError, LaunchError
    from clustertrain.train.metrics import format_duration, read_metrics
    from clustertrain.train.status import load_status

    jobs = _jobs()
    run = args.run_dir
    chain = jobs.read_chain(run)
    if not chain and not run.status.exists():
        raise LaunchError(f"{run.root} has no Slurm job chain ({run.job_chain}) and no status.json; "
                          "is it a run directory?")
    # Paths stay whole, for copy and paste; no markup or emoji codes: the files' own text (an error, a job id) is
    # shown as it is, but escaped (`printable`) and each value cut to a line (`cut`).
    console = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)
    damaged = False

    def say(label: str, text: str) -> None:
        console.print(Text.assemble((label, "bold"), " ", printable(text)))

    say("run", str(run.root.resolve()))
    console.print(job_table(jobs.job_rows(chain)))
    try:
        status = load_status(run) or {}
    except (OSError, ValueError) as e:  # files.read_regular's OSError says what is wrong in its strerror
        status, damaged = {}, True
        say("state", f"unknown: {run.status} is damaged ({cut(getattr(e, 'strerror', None) or e)})")
    if status:
        said = str(status.get("reason") or status.get("error") or "").splitlines()
        detail = cut(said[0]) + (" …" if len(said) > 1 else "") if said else ""
        say("state", f"{cut(status['state'], CELL_CHARS)} at step {cut(status.get('step'), CELL_CHARS)}/"
                     f"{cut(status.get('total_steps'), CELL_CHARS)}" + (f" ({detail})" if detail else "")
                     + f", {_clock(status.get('time'))}")
    checkpoint = latest_checkpoint(run.checkpoints)
    say("checkpoint", str(checkpoint or "-"))
    metrics = run.metrics
    try:
        records = [r for r in read_metrics(metrics) if r.get("loss") is not None] if metrics.exists() else []
    except DataError as e:  # a FIFO, a device, a malformed line: named; the chain and state above still stand
        records, damaged = [], True
        say("progress", f"unknown: {cut(e)}")
    total = status.get("total_steps")
    if records and type(total) is int and total > 0 and records[-1]["step"] > 0:
        last = records[-1]
        line = f"step {last['step']}/{total} ({100 * last['step'] / total:.0f}%), loss {last['loss']:.4f}"
        if last.get("tokens_per_s") and last.get("tokens"):
            remaining = (total - last["step"]) * last["tokens"] / last["step"] / last["tokens_per_s"]
            if math.isfinite(remaining):
                line += f", {last['tokens_per_s']:,.0f} tokens/s, eta {format_duration(remaining)} of training"
        say("progress", line)
    started = [e for e in chain if e["event"] == "started"]
    if started:
        say("log", f"tail -f {cut(run.job_log(started[-1]['job_id']))}")
    return 1 if damaged else 0


def job_table(rows: list[dict]):
    """The job chain (launch.jobs.job_rows) as the table `slurm status` and `status` print: one row per start; the
    nodes kept off the next start in a last column, when any were. Each cell is `printable`, cut to CELL_CHARS."""
    from rich.table import Table

    def cell(value: Any) -> str:
        return printable(cut("" if value is None else value, CELL_CHARS))

    excluded = any(row["excluded"] for row in rows)
    table = Table("job", "restart", "state", "started", "ended", "exit", "nodes", *(["excluded"] * excluded), box=None)
    for row in rows:
        table.add_row(cell(row["job"]), cell(row["restart"]), cell(row["state"]), _clock(row["started"]),
                      _clock(row["ended"]), cell(row["exit_code"]), cell(row["nodes"]),
                      *([cell(row["excluded"])] * excluded))
    return table


def _clock(timestamp: float | None) -> str:
    try:
        return datetime.datetime.fromtimestamp(timestamp).strftime("%m-%d %H:%M:%S") if timestamp else ""
    except (TypeError, ValueError, OverflowError, OSError):  # a hand-edited file: NaN, year 10^20, a string
        return "?"
