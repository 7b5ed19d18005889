"""`clustertrain train [CONFIG]`: train under whatever launcher started this process, or --nproc local ranks."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from clustertrain.distributed.stop import EarlySignals


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("train", help="train a model from a config (no config: the embedded default)")
    parser.add_argument("config", nargs="?", help="YAML or TOML config; omit for the embedded default")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. optim.lr=3e-4")
    parser.add_argument("--nproc", type=int, default=None, help="start this many local ranks (like torchrun)")
    parser.add_argument("--resume", default=None, help="auto, none, or a checkpoint path (sets train.resume)")
    parser.add_argument("--overwrite", action="store_true",
                        help="with --resume none: start over, moving the old run's files to replaced-<time>/")
    parser.add_argument("--log-all-ranks", action="store_true", help="let every rank print (debug hangs)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from clustertrain.distributed.stop import listen_early

    # Before the slow imports (torch takes seconds): a SIGTERM now must not kill the run silently (exit 143),
    # and a launcher's held-back signals arrive here; the trainer honours them at step 1.
    with listen_early() as early:
        return _run(args, early)


def _run(args: argparse.Namespace, early: EarlySignals) -> int:
    from clustertrain.errors import ConfigError
    from clustertrain.resolve.load import load_checked_config

    overrides = [*args.set, *([f"train.resume={args.resume}"] if args.resume else []),
                 *(["train.overwrite=true"] if args.overwrite else [])]
    config = load_checked_config(args.config, overrides)  # fail fast, before any rank starts
    if args.nproc is not None:
        if args.nproc < 1:
            raise ConfigError(f"--nproc {args.nproc}: must be at least 1")
        from clustertrain.distributed.spawn import spawn_local

        argv = ["train", *([args.config] if args.config else []), *(f"--set={o}" for o in overrides)]
        return spawn_local(args.nproc, argv + (["--log-all-ranks"] if args.log_all_ranks else []), early)

    from clustertrain.launch.slurm import rank_start_warnings

    for line in rank_start_warnings(args.config, config.slurm, os.environ):  # a rank started by hand on a cluster
        print(line, file=sys.stderr, flush=True)

    from clustertrain.distributed.stop import Preempted
    from clustertrain.distributed.env import is_rank0
    from clustertrain.distributed.faults import fail_start
    from clustertrain.train.metrics import print_best_effort
    from clustertrain.train.trainer import Trainer

    fail_start()  # tests only: CLUSTERTRAIN_FAULT="start@RANK:RESTART=CODE", a start that fails (docs/slurm.md)
    try:
        summary = Trainer(config).run()
    except Preempted as stop:
        if not is_rank0():
            # Only rank 0 reports 75: the checkpoint is committed, and a non-zero exit of another rank would
            # make `srun --kill-on-bad-exit` cut rank 0 short while it closes its files.
            return 0
        print_best_effort(str(stop), sys.stderr)
        return stop.exit_code
    if is_rank0():
        print_summary(summary)
    return 0


def print_summary(summary) -> None:
    """The end-of-run report: where things are, how the loss moved, what the model writes."""
    from rich.text import Text

    from clustertrain.train.metrics import BestEffortConsole, silence

    run = summary.files
    console = BestEffortConsole(highlight=False)  # a closed stdout does not turn a finished run into exit 1
    rows = [
        ("run directory", str(run.root)),
        ("checkpoint", str(summary.checkpoint) if summary.checkpoint else "-"),
        ("metrics", f"{run.metrics}  (TensorBoard: {run.tensorboard})"),
    ]
    if summary.first_loss is not None:
        loss = f"{summary.first_loss:.3f} at step 1 -> {summary.last_loss:.3f} at step {summary.steps}"
        if summary.eval_loss is not None:
            loss += f"  (held-out {summary.eval_loss:.3f})"
        rows.append(("loss", loss))
    if summary.sample:
        rows.append(("sample", summary.sample.replace("\n", "\n" + " " * 15)))
    for name, value in rows:
        console.print(Text.assemble((f"{name:>13}", "bold"), "  ", value), soft_wrap=True)
    try:
        sys.stdout.flush()
    except OSError:
        silence(sys.stdout)
