"""The `clustertrain` command line. Each command lives in its own module; user errors exit 2 in one line.

    clustertrain train                              # the embedded default: a tiny Llama on Python's stdlib
    clustertrain train configs/tiny-llama.yaml --nproc 2 --set optim.lr=1e-3
    clustertrain train configs/tiny-llama.yaml --optim.lr 1e-3 --data.sources.0.path data/train.jsonl
    torchrun --nproc_per_node 8 -m clustertrain train configs/tiny-llama.yaml
    srun -N 2 --ntasks-per-node 8 clustertrain train configs/tiny-llama.yaml
    clustertrain verify configs/tiny-llama.yaml --nproc 2 --set parallel.strategy=zero3  # losses match 1 rank
    srun -N 2 --ntasks-per-node 8 clustertrain doctor configs/tiny-llama.yaml   # every rank checked, slow ones named
    clustertrain config show configs/tiny-llama.yaml
    clustertrain config keys optim                            # every key: type, default, help
    clustertrain config convert torchtitan.toml               # a torchtitan, TRL/HF (+ DeepSpeed) or stub config
    clustertrain tokenizer train configs/tiny-llama.yaml tokenizers/code-4k
    clustertrain data audit runs/tiny-llama
    clustertrain stage dataset HuggingFaceTB/finemath data/finemath --subset finemath-4plus --max-rows 1M
    clustertrain export runs/tiny-llama exports/tiny-llama      # HF safetensors directory
    clustertrain import path/to/hf-model checkpoints/start      # a checkpoint to start from (--resume PATH)
    clustertrain slurm submit configs/tiny-llama.yaml --set slurm.nodes=2   # sbatch, requeued until done
    clustertrain slurm status runs/tiny-llama
    clustertrain status runs/tiny-llama                       # state, heartbeats, slowest rank, a hang, retries
    clustertrain plot runs/tiny-llama                         # loss, lr, tokens/s, MFU, memory as a PNG
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys

from clustertrain.cli.logs import LOG_LEVELS, setup_logging
from clustertrain.cli.options import add_shared_flags, dotted_to_set, reject_extras, version_line
from clustertrain.errors import ExitCode, UserError, note_user_error
from clustertrain.torch_check import installed_torch, torch_problem

# Login-node commands: they never import torch.
WITHOUT_TORCH = {"download", "stage", "config", "slurm", "env", "plot", "status"}


def build_parser() -> argparse.ArgumentParser:
    from clustertrain.cli import (config_cmd, data_cmd, doctor_cmd, download_cmd, env_cmd, eval_cmd, export_cmd,
                                  generate_cmd, plan_cmd, plot_cmd, slurm_cmd, stage_cmd, status_cmd, tokenizer_cmd,
                                  train_cmd, verify_cmd)

    parser = argparse.ArgumentParser(
        prog="clustertrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=version_line())
    parser.add_argument("--log-level", choices=LOG_LEVELS, type=str.lower, default=None,
                        help="what the run says: debug, info (the default), warning (warnings and errors only), "
                        "error; library warnings show from debug on (set for the ranks a command starts too)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (train_cmd, verify_cmd, doctor_cmd, config_cmd, plan_cmd, data_cmd, tokenizer_cmd, export_cmd,
                   generate_cmd, eval_cmd, download_cmd, stage_cmd, slurm_cmd, status_cmd, env_cmd, plot_cmd):
        module.add_parser(commands)
    add_shared_flags(parser, LOG_LEVELS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the command line (`argv`, else this process's own) and run the command; returns the exit code."""
    code = _main(argv)
    if argv is None:  # the process's own command: its exit code is decided
        keep_exit_code(code)
        trackers = sys.modules.get("clustertrain.train.trackers")
        if trackers is not None and trackers.stalled():  # see trackers.stalled: the shutdown could abort
            _exit_now(code)
    return code


def keep_exit_code(code: int) -> None:
    """The command has ended and cleaned up with `code`: a SIGTERM until the process is gone ends it at once with
    `code`, not 143. A launcher ends the other ranks once one has exited (srun --kill-on-bad-exit, torchrun), and
    a rank still unwinding the interpreter then turned the job's exit code (and Slurm's state) into a kill. What
    the process started (DataLoader workers) ends with it: os._exit skips their shutdown."""
    signal.signal(signal.SIGTERM, lambda signum, frame: _exit_now(code))


def _exit_now(code: int) -> None:
    """End the process with `code` at once, after its output and what it started (os._exit skips both)."""
    from clustertrain.distributed.spawn import end_descendants

    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    end_descendants()
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        argv, typed = dotted_to_set(sys.argv[1:] if argv is None else list(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    args, extras = parser.parse_known_args(argv)
    if args.command is None:  # a bare `clustertrain`: what it can do, not a usage error
        parser.print_help()
        return 0
    reject_extras(parser, argv, extras, typed)
    setup_logging(args.log_level, getattr(args, "log_all_ranks", False))
    logging.getLogger("clustertrain.cli").debug("clustertrain %s, arguments as read: %s", args.command, argv)
    if args.command not in WITHOUT_TORCH and (problem := torch_problem(installed_torch())):
        print(f"error: {problem}", file=sys.stderr)
        return ExitCode.USER_ERROR
    if args.command not in ("download", "stage"):  # the two that fetch from the hub, on a login node
        work_offline()
    try:
        return args.run(args) or 0
    except UserError as e:
        shown = getattr(e, "shown", False)  # by the rank that had it (clustertrain/distributed/failures.py)
        from clustertrain.distributed.env import is_rank0
        from clustertrain.train.metrics import print_best_effort

        # A login-node command is one process, and asking torch would import it (seconds, or missing there).
        rank0 = args.command in WITHOUT_TORCH or is_rank0()
        if (rank0 or getattr(args, "log_all_ranks", False)) and not shown:
            # A closed stderr must not turn the exit code that says what happened into a traceback's 1.
            print_best_effort(f"error: {e}", sys.stderr)
        if args.command == "train":
            note_user_error(e)
        return e.exit_code
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED


def work_offline(env: dict[str, str] = os.environ) -> None:
    """Keep every command but `download` off the network: a model, adapter base or dataset not in the local
    cache then fails at once, naming what to download, instead of retrying the hub. Set before transformers and
    huggingface_hub are imported (they read it once); an explicit HF_HUB_OFFLINE=0 asks for the hub."""
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", env["HF_HUB_OFFLINE"])
