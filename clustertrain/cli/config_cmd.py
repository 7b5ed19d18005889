"""`clustertrain config show|check|keys|convert`: the resolved config, a check against a world size, the keys,
and a config converted from torchtitan, HF/TRL TrainingArguments (+ DeepSpeed) or the training stub.

    clustertrain config show configs/tiny-llama.yaml
    clustertrain config show configs/frontier-llama3-8b.yaml --nodes 64      # as the run will resolve it there
    clustertrain config check configs/frontier-llama3-8b.yaml --nodes 64     # ranks per node from its slurm section
    clustertrain config check configs/tiny-llama.yaml --world 40 --set parallel.tp=2
    clustertrain config keys parallel                                         # types, defaults, help
    clustertrain config convert llama3_8b.toml -o llama3_8b.yaml              # torchtitan
    clustertrain config convert sft_args.json ds_config.json -o sft.yaml       # TRL/HF + DeepSpeed
    clustertrain config convert test_config_training.yaml -o stub.yaml         # the DDP/ZeRO training stub
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from clustertrain.resolve.run import Resolved


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("config", help="inspect configs")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="print the resolved config as YAML")
    show.add_argument("config", nargs="?", help="YAML or TOML config; omit for the embedded default")
    show.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. optim.lr=3e-4")
    _add_world(show, required=False, what="resolve it for this world as the run will: layout, batch, paths")
    show.set_defaults(run=run_show)
    check = actions.add_parser(
        "check", help="check a config against a number of ranks before any starts (on a login node: reads the "
        "model's config.json, no weights); every problem at once, exit 2")
    check.add_argument("config", nargs="?", help="YAML or TOML config; omit for the embedded default")
    _add_world(check, required=True, what="ranks in all")
    check.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. optim.lr=3e-4")
    check.set_defaults(run=run_check)
    keys = actions.add_parser("keys", help="list the config keys with their types, defaults and help")
    keys.add_argument("section", nargs="?", help="a section (optim) or key prefix (data.sources); default: all")
    keys.set_defaults(run=run_keys)
    convert = actions.add_parser(
        "convert", help="write a clustertrain config from a torchtitan TOML, HF/TRL TrainingArguments (JSON or YAML) "
        "with a DeepSpeed JSON, or the training stub's YAML; one line per key not mapped")
    convert.add_argument("file", help="the config to convert (.toml, .json, .yaml)")
    convert.add_argument("ds_config", nargs="?", help="a DeepSpeed JSON to go with TrainingArguments (default: "
                         "their `deepspeed` key)")
    convert.add_argument("-o", "--out", metavar="YAML", help="write the config here (default: print it); never "
                         "over an input, nor over an existing file without --force")
    convert.add_argument("--force", action="store_true", help="replace the -o file if it exists (never an input)")
    convert.add_argument("--from", dest="source", choices=("torchtitan", "hf", "stub"),
                         help="the file's format (default: told from its extension and keys)")
    convert.set_defaults(run=run_convert)


def _add_world(parser: argparse.ArgumentParser, required: bool, what: str) -> None:
    size = parser.add_mutually_exclusive_group(required=required)
    size.add_argument("--world", type=int, metavar="N", help=f"ranks in all: {what}")
    size.add_argument("--nodes", type=int, metavar="N",
                      help="nodes, each running the ranks per node of the config's slurm section and preset")


def _world(args: argparse.Namespace, config) -> tuple[int, int, str]:
    """(ranks, ranks per node, where: one phrase naming the config and the world) of --world or --nodes."""
    from clustertrain.errors import UserError
    from clustertrain.launch.slurm import job_spec

    given = args.world if args.world is not None else args.nodes
    if given < 1:
        raise UserError(f"--{'world' if args.world is not None else 'nodes'} {given}: must be at least 1")
    per_node = job_spec(config.slurm).tasks_per_node
    world = args.world if args.world is not None else args.nodes * per_node
    where = f"{args.config or 'the default config'} on {world} rank(s)"
    if args.nodes is not None:
        where += f" ({args.nodes} node(s) × {per_node})"
    return world, per_node if world % per_node == 0 else world, where


def run_show(args: argparse.Namespace) -> int:
    from clustertrain.config.load import dump_config
    from clustertrain.resolve.load import load_checked_config

    config = load_checked_config(args.config, args.set)
    if args.world is None and args.nodes is None:
        print(dump_config(config), end="")
        return 0
    from clustertrain.resolve.run import resolve

    world, local, where = _world(args, config)
    run = resolve(config, world, local, None if config.parallel.device == "auto" else config.parallel.device)
    print(f"# {where}: {_summary(run)}")
    print(dump_config(run.config), end="")
    return 0


def _summary(run: Resolved) -> str:
    """The layout and the steps of a run settled on its world, in one line."""
    from clustertrain.config.budget import total_steps

    config = run.config
    steps = (f"train.epochs {config.train.epochs:g} (steps counted from the data at start)" if config.train.epochs
             else f"{total_steps(config):,} steps")
    return f"{run.layout.describe(config.data.seq_len)}; {steps}"


def run_check(args: argparse.Namespace) -> int:
    from clustertrain.config.layout import check_world
    from clustertrain.errors import ConfigError, UserError
    from clustertrain.model.spec import model_shape
    from clustertrain.resolve.load import load_checked_config
    from clustertrain.resolve.run import resolve

    config = load_checked_config(args.config, args.set)
    world, local, where = _world(args, config)
    problems, shape = [], None
    try:  # the model's config.json, or its arch and fields: heads and layers, never weights
        shape = model_shape(config.model, config.data.vocab_size)
    except UserError as e:
        problems.append(str(e))
    problems += check_world(config, world, local, shape)
    if problems:
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise ConfigError(f"{where}: {count}\n" + "\n".join(f"  {p}" for p in problems))
    device = None if config.parallel.device == "auto" else config.parallel.device
    print(f"OK: {where}: {_summary(resolve(config, world, local, device))}")
    return 0


def run_keys(args: argparse.Namespace) -> int:
    from clustertrain.config.keys import describe_keys, schema_keys

    print(describe_keys(schema_keys(args.section)), end="")
    return 0


def run_convert(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from clustertrain.cli.outputs import write_output
    from clustertrain.config.convert import convert, one_line

    conversion = convert(args.file, args.ds_config, args.source)
    text = conversion.to_yaml(Path(args.file).name + (f" + {Path(args.ds_config).name}" if args.ds_config else ""))
    if args.out:
        write_output(args.out, text, conversion.inputs, args.force)
    else:
        print(text, end="")
    for line in conversion.unmapped:
        print(f"not mapped: {one_line(line)}", file=sys.stderr)
    for line in conversion.warnings:
        print(f"warning: {one_line(line)}", file=sys.stderr)
    if args.out:
        print(f"wrote {args.out} ({len(conversion.unmapped)} key(s) not mapped); check it with: clustertrain config "
              f"check {args.out} --world N", file=sys.stderr)
    return 0
