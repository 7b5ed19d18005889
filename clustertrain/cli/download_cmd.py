"""`clustertrain download REPO_ID [REPO_ID...]`: stage models or datasets in the HF cache, on a machine with network.

    clustertrain download Qwen/Qwen2.5-0.5B                          # into $HF_HOME/hub (HF_HUB_CACHE)
    clustertrain download meta-llama/Llama-3.1-8B Qwen/Qwen2.5-0.5B  # several: each fetched and reported
    clustertrain download facebook/opt-2.7b --exclude '*.bin'        # safetensors only, not both formats
    clustertrain download meta-llama/Llama-3.1-8B --exclude 'original/*'  # not Meta's own second copy
    clustertrain download HuggingFaceFW/fineweb-edu --dataset --revision v1.4.0
    clustertrain download Qwen/Qwen2.5-0.5B --verify                 # re-hash every file, name the bad ones
    clustertrain download my-org/model --from-dir /mnt/transfer/model  # no hub: copy a directory in

Files already complete are not fetched again (--force refetches). --include and --exclude are glob patterns
(repeatable) as the hub client takes them (allow_patterns, ignore_patterns); a folder pattern ends with `/`.
With several ids, one failure does not stop the others; the exit code is 2 if any failed. Run it on a login
node with the HF_HOME the compute nodes use (the frontier and perlmutter presets set HF_HOME=<scratch>/huggingface);
it prints the offline environment and the config line to train with.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from clustertrain.errors import ExitCode


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "download", help="fetch a model or dataset into the HF cache, for compute nodes without network",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("repo_ids", nargs="+", metavar="REPO_ID", help="Hugging Face ids, e.g. Qwen/Qwen2.5-0.5B")
    parser.add_argument("--dataset", action="store_true", help="the ids are datasets, not models")
    parser.add_argument("--include", action="append", metavar="PATTERN",
                        help="fetch only files matching this glob, e.g. '*.safetensors' (repeatable)")
    parser.add_argument("--exclude", action="append", metavar="PATTERN",
                        help="leave out files matching this glob, e.g. '*.bin' (repeatable)")
    parser.add_argument("--revision", help="a branch, tag or commit (default main)")
    parser.add_argument("--cache-dir", help="the HF hub cache to fill (default $HF_HUB_CACHE, else $HF_HOME/hub)")
    parser.add_argument("--force", action="store_true", help="fetch every file again, even if complete")
    parser.add_argument("--verify", action="store_true", help="re-hash every file against the download's manifest")
    parser.add_argument("--from-dir", metavar="DIR",
                        help="copy from a local directory instead of the hub (mirrors, air-gapped transfers)")
    parser.set_defaults(run=run_download)


def run_download(args: argparse.Namespace) -> int:
    import sys

    from clustertrain.errors import UserError
    from clustertrain.model.download import download, hub_cache, local_fetch

    if args.from_dir and len(args.repo_ids) > 1:
        raise UserError(f"--from-dir copies one directory, so give one REPO_ID, not {len(args.repo_ids)}")
    repo_type = "dataset" if args.dataset else "model"
    fetch = local_fetch(args.from_dir) if args.from_dir else None
    done, failed = [], []
    for repo_id in args.repo_ids:
        try:
            with stop_at_once(repo_id, hub_cache(args.cache_dir)):
                result = download(repo_id, repo_type=repo_type, revision=args.revision, cache_dir=args.cache_dir,
                                  force=args.force, verify=args.verify, fetch=fetch, include=args.include,
                                  exclude=args.exclude)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            failed.append(repo_id)
            continue
        if result.partial_bytes:
            print(f"removed {human_size(result.partial_bytes)} of partial files that a stopped download of {repo_id} "
                  "had left")
        what = f"{repo_type} {repo_id} ({result.files} files, {human_size(result.size_bytes)})"
        if result.fetched:
            print(f"downloaded {what} into {result.snapshot} (why: {result.reason}); every file hashed and recorded")
        else:
            checked = "every file re-hashed and matches" if result.verified else "sizes match; --verify re-hashes"
            print(f"already complete: {what} in {result.snapshot}; {checked}; nothing fetched (--force refetches)")
        done.append((repo_id, result))
    if done:
        print_usage(args, done)
    if failed and len(args.repo_ids) > 1:
        print(f"error: {len(failed)} of {len(args.repo_ids)} downloads failed: {', '.join(failed)}", file=sys.stderr)
    return ExitCode.USER_ERROR if failed else ExitCode.OK


@contextlib.contextmanager
def stop_at_once(repo_id: str, cache) -> Iterator[None]:
    """While downloading `repo_id`, a stop signal (SIGTERM from `kill` or a job's end, Ctrl-C) ends the command at
    once: one line, this download's partial files removed, exit 75 (run the same command again to finish it).

    At once rather than by an exception: the hub client's download threads would finish every file first. Files
    already complete stay in the cache, and the next download fetches only what is missing."""
    import os
    import signal
    import sys

    from clustertrain.distributed.stop import STOP_SIGNALS
    from clustertrain.model.download import remove_own_partial_files

    def stop(signum: int, _frame) -> None:
        freed = remove_own_partial_files(cache)
        removed = f"its partial files ({human_size(freed)}) removed" if freed else "no partial file left"
        with contextlib.suppress(OSError):
            print(f"\nerror: the download of {repo_id} was stopped by {signal.Signals(signum).name}; {removed}, "
                  "complete files kept: run the same command again to finish it", file=sys.stderr, flush=True)
        os._exit(ExitCode.REQUEUE)

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def print_usage(args: argparse.Namespace, done: list) -> None:
    """The environment of offline compute nodes, and the config lines that find the downloads there."""
    from clustertrain.launch.slurm import OFFLINE_ENV

    cache = done[0][1].cache_dir
    where = {"HF_HOME": str(cache.parent)} if cache.name == "hub" else {"HF_HUB_CACHE": str(cache)}
    print("\nOn compute nodes (no network), export:")
    for name, value in (where | OFFLINE_ENV).items():
        print(f"  export {name}={value}")
    print("(`clustertrain slurm submit` exports these itself when the preset has a scratch: "
          "HF_HOME=<scratch>/huggingface)")
    print("\nand in the run config:")
    for repo_id, result in done:
        if args.dataset:
            print(f"  data.sources: [{{hf_name: {repo_id}}}]")
        elif args.revision:  # model.hub_id finds the revision main points to
            print(f"  model.path: {result.snapshot}")
        else:
            print(f"  model.hub_id: {repo_id}")
    if args.dataset and args.revision:
        print("  (hf_name reads the revision main points to)")


def human_size(size: int) -> str:
    """Bytes as a short human number: 812 B, 1.4 MB, 15.2 GB."""
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"
