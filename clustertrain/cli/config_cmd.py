"""`clustertrain config show|check CONFIG`: print the resolved config, or check it against a world size.

    clustertrain config show configs/tiny-llama.yaml
    clustertrain config check configs/frontier-llama3-8b.yaml --nodes 64     # ranks per node from its slurm section
    clustertrain config check configs/tiny-llama.yaml --world 40 --set parallel.tp=2
"""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("config", help="inspect configs")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="print the resolved config as YAML")
    show.add_argument("config", nargs="?", help="YAML or TOML config; omit for the embedded default")
    show.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. optim.lr=3e-4")
    show.set_defaults(run=run_show)
    check = actions.add_parser(
        "check", help="check a config against a number of ranks before any starts (on a login node: reads the "
        "model's config.json, no weights); every problem at once, exit 2")
    check.add_argument("config", nargs="?", help="YAML or TOML config; omit for the embedded default")
    size = check.add_mutually_exclusive_group(required=True)
    size.add_argument("--world", type=int, metavar="N", help="ranks in all")
    size.add_argument("--nodes", type=int, metavar="N",
                      help="nodes, each running the ranks per node of the config's slurm section and preset")
    check.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. optim.lr=3e-4")
    check.set_defaults(run=run_check)


def run_show(args: argparse.Namespace) -> int:
    from clustertrain.config.load import dump_config, load_config

    print(dump_config(load_config(args.config, args.set)), end="")
    return 0


def run_check(args: argparse.Namespace) -> int:
    from clustertrain.config.checks import apply_layout, check_world, resolve_layout, total_steps
    from clustertrain.config.load import load_config
    from clustertrain.errors import ConfigError, UserError
    from clustertrain.launch.slurm import job_spec
    from clustertrain.parallel.tp import model_shape

    given = args.world if args.world is not None else args.nodes
    if given < 1:
        raise UserError(f"--{'world' if args.world is not None else 'nodes'} {given}: must be at least 1")
    config = load_config(args.config, args.set)
    per_node = job_spec(config.slurm).tasks_per_node
    world = args.world if args.world is not None else args.nodes * per_node
    local = per_node if world % per_node == 0 else world
    where = f"{args.config or 'the default config'} on {world} rank(s)"
    if args.nodes is not None:
        where += f" ({args.nodes} node(s) × {per_node})"
    problems, shape = [], None
    try:  # the model's config.json, or its arch and fields: heads and layers, never weights
        shape = model_shape(config.model, config.data.vocab_size)
    except UserError as e:
        problems.append(str(e))
    problems += check_world(config, world, local, shape)
    if problems:
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise ConfigError(f"{where}: {count}\n" + "\n".join(f"  {p}" for p in problems))
    layout = resolve_layout(config, world, local, shape)
    apply_layout(config, layout)
    steps = (f"train.epochs {config.train.epochs:g} (steps counted from the data at start)" if config.train.epochs
             else f"{total_steps(config):,} steps")
    print(f"OK: {where}: {layout.describe(config.data.seq_len)}; {steps}")
    return 0
