"""`clustertrain config show CONFIG`: print the resolved config (file + overrides + defaults)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("config", help="inspect configs")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="print the resolved config as YAML")
    show.add_argument("config", nargs="?", help="YAML or TOML config; omit for the embedded default")
    show.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. optim.lr=3e-4")
    show.set_defaults(run=run_show)


def run_show(args: argparse.Namespace) -> int:
    from clustertrain.config.load import dump_config, load_config

    print(dump_config(load_config(args.config, args.set)), end="")
    return 0
