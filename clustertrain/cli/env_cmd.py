"""`clustertrain env CONFIG`: the site's environment of the config's preset, for a shell that starts ranks by hand.

    salloc -N 2 ...                                  # an interactive allocation
    eval "$(clustertrain env configs/frontier-llama.yaml)"
    srun ... python -m clustertrain train configs/frontier-llama.yaml

It prints the module loads, exports and setup lines of the job script that `clustertrain slurm render` writes
(the preset's, then the config's slurm.modules, slurm.env and slurm.setup), so that ranks started under
`salloc`, a hand-typed `srun` or `torchrun` see what a submitted job's ranks see.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "env", help="print the module loads and exports of the config's Slurm preset (as its job script runs "
        "them), for `eval` in an interactive allocation", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="YAML or TOML config; omit for the embedded default")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override, e.g. slurm.preset=frontier")
    parser.set_defaults(run=run_env)


def run_env(args: argparse.Namespace) -> int:
    from clustertrain.config.load import load_config
    from clustertrain.launch.slurm import environment_lines

    sys.stdout.write(environment_lines(load_config(args.config, args.set).slurm))
    return 0
