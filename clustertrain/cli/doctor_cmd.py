"""`clustertrain doctor [CONFIG]`: launched like a training run, every rank checks what the run needs and measures
its device and links; one table, exit 0 when everything passed, 1 otherwise (see docs/doctor.md).

    clustertrain doctor configs/tiny-llama.yaml --nproc 2
    torchrun --nproc_per_node 8 -m clustertrain doctor configs/llama.yaml
    srun -N 4 --ntasks-per-node 8 clustertrain doctor configs/frontier-llama.yaml --output doctor.json
    clustertrain slurm submit configs/frontier-llama.yaml --doctor     # a job step before training
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "doctor", help="check every rank (versions, environment, files, disk, device memory) and measure its matmul "
        "and links before a run; exit 1 naming what fails", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="YAML or TOML config; omit for the embedded default")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. parallel.tp=2")
    parser.add_argument("--nproc", type=int, default=None, help="start this many local ranks (like torchrun)")
    parser.add_argument("--slow", type=float, default=1.25, metavar="RATIO",
                        help="a rank or link slower than the median by more than this factor fails (default 1.25)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    parser.add_argument("--output", type=Path, metavar="JSON", help="also write the results (with bad_hosts) here")
    parser.add_argument("--log-all-ranks", action="store_true", help="let every rank print (debug hangs)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from clustertrain.errors import ConfigError
    from clustertrain.resolve.load import load_checked_config

    if not args.slow > 1:
        raise ConfigError(f"--slow {args.slow:g}: give a factor above 1, e.g. 1.25 (25% slower than the median)")
    config = load_checked_config(args.config, args.set)
    if args.nproc is not None:
        if args.nproc < 1:
            raise ConfigError(f"--nproc {args.nproc}: must be at least 1")
        from clustertrain.distributed.spawn import spawn_local

        argv = ["doctor", *([args.config] if args.config else []), *(f"--set={o}" for o in args.set),
                f"--slow={args.slow}", *(["--json"] if args.json else []),
                *([f"--output={args.output}"] if args.output else []),
                *(["--log-all-ranks"] if args.log_all_ranks else [])]
        return spawn_local(args.nproc, argv)

    from clustertrain.doctor.run import run_doctor

    return run_doctor(config, args.config, args.slow, args.json, args.output)
