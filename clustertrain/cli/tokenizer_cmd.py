"""`clustertrain tokenizer train CONFIG OUT_DIR`: a byte-level BPE trained on the config's sources."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("tokenizer", help="train tokenizers")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    train = actions.add_parser("train", help="train a byte-level BPE on data.sources, save an HF tokenizer directory")
    train.add_argument("config", nargs="?", help="YAML or TOML config; omit for the embedded default")
    train.add_argument("out_dir", help="where to write the tokenizer (tokenizer.json and friends)")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. data.vocab_size=8192")
    train.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from clustertrain.data.tokenize import train_bpe
    from clustertrain.errors import UserError
    from clustertrain.resolve.load import load_checked_config

    config = load_checked_config(args.config, args.set)
    out = Path(args.out_dir)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty; choose a new directory")
    train_bpe(config.data, out)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True, trust_remote_code=False)
    print(f"trained a {len(tokenizer)}-token byte-level BPE on {len(config.data.sources)} source(s) into {out}")
    print(f"use it with: --set data.tokenizer={out}")
    return 0
