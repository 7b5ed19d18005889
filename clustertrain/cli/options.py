"""Flags shared by every command: `--section.key VALUE` overrides, `--version`, and the key list in `--help`."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from importlib import metadata

from clustertrain.errors import ConfigError

# `--optim.lr`, `--data.sources.0.path`: a dotted name, never one of our own flags (they have no dots)
_DOTTED = re.compile(r"--([A-Za-z_][\w-]*(?:\.[\w-]+)+)(?:=(.*))?", re.DOTALL)
KEYS_EPILOG = ("Any config key is also a flag: --section.key VALUE or --section.key=VALUE, the same as --set "
               "section.key=VALUE (list items by index: --data.sources.0.path PATH). `clustertrain config keys` lists "
               "the keys with their types, defaults and help.")


def dotted_to_set(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """`--optim.lr 1e-3` and `--optim.lr=1e-3` (the torchtitan and litgpt habit) rewritten as `--set=optim.lr=1e-3`,
    in place, so that they apply in the order given among the `--set`s.

    Returns:
        The rewritten argv, and each rewritten argument mapped to the flag the user typed (for error messages).
    """
    out: list[str] = []
    typed: dict[str, str] = {}
    items = iter(argv)
    for arg in items:
        if arg == "--":
            out += [arg, *items]
            break
        match = _DOTTED.fullmatch(arg)
        if not match:
            out.append(arg)
            continue
        key, value = match.group(1), match.group(2)
        if value is None:
            value = next(items, None)
            if value is None or value.startswith("--"):
                raise ConfigError(f"--{key} needs a value: --{key} VALUE or --{key}=VALUE")
        rewritten = f"--set={key}={value}"
        out.append(rewritten)
        typed[rewritten] = f"--{key}"
    return out, typed


def reject_extras(parser: argparse.ArgumentParser, argv: list[str], extras: list[str], typed: dict[str, str]) -> None:
    """argparse's error for arguments no parser took, from the command's own parser (its usage line), naming a
    `--section.key` flag given to a command without a config as such."""
    if not extras:
        return
    command = _command_parser(parser, argv)
    for extra in extras:
        if extra in typed:
            command.error(f"{typed[extra]}: `{command.prog}` takes no config, so no config key flags")
    command.error(f"unrecognized arguments: {' '.join(extras)}")


def _command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the (sub)command that `argv` names: `config show` under `config`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = next((action.choices[arg] for arg in argv if arg in action.choices), None)
            return parser if chosen is None else _command_parser(chosen, argv)
    return parser


def version_line() -> str:
    """clustertrain's version and torch's, read from the installed packages' metadata (torch is not imported)."""
    return f"clustertrain {_installed('clustertrain')} (torch {_installed('torch')})"


def _installed(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        if name == "clustertrain":
            from clustertrain import __version__

            return __version__
        return "not installed"


def commands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every parser under `parser` that runs a command (the leaves below its subcommands)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser
    for action in subs:
        for sub in dict.fromkeys(action.choices.values()):
            yield from commands(sub)


def add_shared_flags(parser: argparse.ArgumentParser, log_levels: tuple[str, ...]) -> None:
    """`--log-level` after the command too, and in every `--help` of a command that takes a config, its
    `--section.key` flags and `clustertrain config keys`."""
    for sub in commands(parser):
        if parser is not sub:
            sub.add_argument("--log-level", choices=log_levels, type=str.lower, default=argparse.SUPPRESS,
                             help="debug, info, warning or error (as before the command)")
        if any(action.dest == "set" for action in sub._actions):
            sub.epilog = "\n\n".join(filter(None, [sub.epilog, KEYS_EPILOG]))
