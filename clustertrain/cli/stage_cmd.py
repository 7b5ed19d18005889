"""`clustertrain stage dataset NAME_OR_PATH OUT`: stream a dataset slice into local Parquet shards, on a login node.

    clustertrain stage dataset HuggingFaceTB/finemath /scratch/data/finemath --subset finemath-4plus \\
        --max-tokens 10B --tokenizer /scratch/models/Llama-3.2-1B
    clustertrain stage dataset Zyphra/Zyda-2 /scratch/data/zyda2 --max-rows 1M --dry-run   # what it would fetch
    clustertrain stage dataset /mnt/transfer/stack-v2 /scratch/data/stack --text-field content --max-rows 500K
    clustertrain stage dataset --verify /scratch/data/finemath                  # re-hash the shards

The rows are read in the source's order through `datasets` streaming, never downloaded whole, and written as
OUT/part-NNNNN.parquet (one `text` column) with OUT/manifest.json: source, subset, split, the hub commit (or a
local path's fingerprint), and each shard's sha256, rows and tokens. Stopped at any moment (a kill, the end of
a job), the same command resumes after the last complete shard. Train on it with `data.sources: [{path: OUT}]`.
--max-tokens counts the tokens a run sees (its tokenizer, plus an EOS per document); numbers take K, M, B, T.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("stage", help="stream a dataset slice into local Parquet shards (on a login node)")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    dataset = actions.add_parser("dataset", help="stream NAME_OR_PATH into Parquet shards in OUT, resumably",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    dataset.add_argument("source", metavar="NAME_OR_PATH", help="a hub dataset id, or a local file or folder")
    dataset.add_argument("out", metavar="OUT", nargs="?", help="the folder for the shards and manifest.json")
    dataset.add_argument("--subset", help="the dataset's config (subset) name, e.g. finemath-4plus")
    dataset.add_argument("--split", default="train", help="the split to read (default train)")
    dataset.add_argument("--max-tokens", metavar="N", help="stop once N tokens are staged (needs --tokenizer)")
    dataset.add_argument("--max-rows", metavar="N", help="stop after N rows")
    dataset.add_argument("--text-field", default="text", help="the field that holds the text (default text)")
    dataset.add_argument("--tokenizer", metavar="PATH", help="the run's tokenizer folder (its data.tokenizer)")
    dataset.add_argument("--shard-rows", metavar="N", default="50K", help="rows per shard (default 50K)")
    dataset.add_argument("--dry-run", action="store_true", help="print what it would fetch and write; write nothing")
    dataset.add_argument("--verify", action="store_true", help="re-hash the shards of the stage in NAME_OR_PATH")
    dataset.set_defaults(run=run_stage)


def count(flag: str, value: str | None) -> int | None:
    """A count flag: 1000, 1_000, 1e9, 10B, 500K (K, M, B, T: thousands to trillions)."""
    from clustertrain.errors import UserError

    if value is None:
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?(?:e\d+)?)([KMBT]?)", value.replace("_", "").replace(",", ""), re.IGNORECASE)
    if not match:
        raise UserError(f"{flag} {value!r} is not a count: give e.g. 1000000, 1e6, 1M or 10B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}[match[2].upper()]
    return int(float(match[1]) * scale)


def command_line(args: argparse.Namespace) -> str:
    """The command that runs this stage again (to finish it), from any folder: local paths made absolute."""
    absolute = lambda path: str(Path(path).expanduser().absolute())  # noqa: E731
    flags = [(flag, getattr(args, flag[2:].replace("-", "_"))) for flag in
             ("--subset", "--split", "--max-tokens", "--max-rows", "--text-field", "--tokenizer", "--shard-rows")]
    flags = [(flag, absolute(value) if flag == "--tokenizer" and value else value) for flag, value in flags]
    source = absolute(args.source) if Path(args.source).expanduser().exists() else args.source
    words = ["clustertrain", "stage", "dataset", source, absolute(args.out)]
    return shlex.join(words + [word for flag, value in flags if value is not None for word in (flag, value)])


def run_stage(args: argparse.Namespace) -> int:
    from clustertrain.data.stage import StageRequest, describe_stage, stage_dataset
    from clustertrain.data.staged import verify_stage
    from clustertrain.errors import UserError

    if args.verify:
        problems = verify_stage(Path(args.source))
        for line in problems:
            print(line)
        print(f"{args.source}: {'every shard matches its sha256' if not problems else f'{len(problems)} problems'}")
        return 1 if problems else 0
    if args.out is None:
        raise UserError("give OUT, the folder for the shards: clustertrain stage dataset NAME_OR_PATH OUT")
    request = StageRequest(
        source=args.source, out=Path(args.out), subset=args.subset, split=args.split, text_field=args.text_field,
        max_rows=count("--max-rows", args.max_rows), max_tokens=count("--max-tokens", args.max_tokens),
        tokenizer=args.tokenizer, shard_rows=count("--shard-rows", args.shard_rows),
        command=command_line(args),
    )
    if args.dry_run:
        for line in describe_stage(request):
            print(line)
        print("dry run: nothing fetched or written")
        return 0
    with shard_progress() as progress:
        manifest = stage_dataset(request, progress=progress.update, on_shard=progress.shard)
    rows = sum(shard["rows"] for shard in manifest["shards"])
    tokens = "" if manifest["tokenizer"] is None else f", {sum(s['tokens'] for s in manifest['shards']):,} tokens"
    done = "staged" if progress.read else "already complete, nothing fetched:"
    print(f"{done} {rows:,} rows{tokens} in {len(manifest['shards'])} shards in {request.out} "
          f"({manifest['ended_by']}); train on it with data.sources: [{{path: {request.out}}}]")
    return 0


class shard_progress:  # noqa: N801 - used as a context manager, named for what it shows
    """A rich progress line (rows, tokens, shards) on a terminal; a plain line per shard in a log."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                            console=self.console, transient=True, disable=not self.console.is_terminal)
        self.task = self.bar.add_task("staging", total=None)
        self.read = False  # whether any row was read (a complete stage run again reads none)

    def __enter__(self) -> shard_progress:
        self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.stop()

    def update(self, rows: int, tokens: int | None, shards: int) -> None:
        self.read = True
        tokens_part = "" if tokens is None else f", {tokens:,} tokens"
        self.bar.update(self.task, description=f"{rows:,} rows{tokens_part}, {shards} shards written")

    def shard(self, manifest: dict) -> None:
        shard = manifest["shards"][-1]
        tokens = "" if shard["tokens"] is None else f", {shard['tokens']:,} tokens"
        line = f"{shard['file']}: {shard['rows']:,} rows{tokens}, sha256 {shard['sha256'][:12]}"
        if self.console.is_terminal:
            self.bar.console.print(line)
        else:
            print(line, flush=True)
