"""`clustertrain download REPO_ID`: stage a model or dataset in the HF cache on a machine with network.

    clustertrain download Qwen/Qwen2.5-0.5B                          # into $HF_HOME/hub (HF_HUB_CACHE)
    clustertrain download HuggingFaceFW/fineweb-edu --dataset --revision v1.4.0
    clustertrain download Qwen/Qwen2.5-0.5B --verify                 # re-hash every file, name the bad ones
    clustertrain download my-org/model --from-dir /mnt/transfer/model  # no hub: copy a directory in

Files already complete are not fetched again (--force refetches). Run it on a login node with the HF_HOME the
compute nodes use (the frontier and perlmutter presets set HF_HOME=<scratch>/huggingface); it prints the
offline environment and the config line to train with.
"""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "download", help="fetch a model or dataset into the HF cache, for compute nodes without network",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("repo_id", metavar="REPO_ID", help="a Hugging Face id, e.g. Qwen/Qwen2.5-0.5B")
    parser.add_argument("--dataset", action="store_true", help="REPO_ID is a dataset, not a model")
    parser.add_argument("--revision", help="a branch, tag or commit (default main)")
    parser.add_argument("--cache-dir", help="the HF hub cache to fill (default $HF_HUB_CACHE, else $HF_HOME/hub)")
    parser.add_argument("--force", action="store_true", help="fetch every file again, even if complete")
    parser.add_argument("--verify", action="store_true", help="re-hash every file against the download's manifest")
    parser.add_argument("--from-dir", metavar="DIR",
                        help="copy from a local directory instead of the hub (mirrors, air-gapped transfers)")
    parser.set_defaults(run=run_download)


def run_download(args: argparse.Namespace) -> int:
    from clustertrain.launch.slurm import OFFLINE_ENV
    from clustertrain.model.download import download, local_fetch

    repo_type = "dataset" if args.dataset else "model"
    fetch = local_fetch(args.from_dir) if args.from_dir else None
    result = download(args.repo_id, repo_type=repo_type, revision=args.revision, cache_dir=args.cache_dir,
                      force=args.force, verify=args.verify, fetch=fetch)
    what = f"{repo_type} {args.repo_id} ({result.files} files, {human_size(result.size_bytes)})"
    if result.fetched:
        print(f"downloaded {what} into {result.snapshot} (why: {result.reason}); every file hashed and recorded")
    else:
        checked = "every file re-hashed and matches" if result.verified else "sizes match; --verify re-hashes"
        print(f"already complete: {what} in {result.snapshot}; {checked}; nothing fetched (--force refetches)")

    cache = result.cache_dir
    where = {"HF_HOME": str(cache.parent)} if cache.name == "hub" else {"HF_HUB_CACHE": str(cache)}
    print("\nOn compute nodes (no network), export:")
    for name, value in (where | OFFLINE_ENV).items():
        print(f"  export {name}={value}")
    print("(`clustertrain slurm submit` exports these itself when the preset has a scratch: "
          "HF_HOME=<scratch>/huggingface)")
    print("\nand in the run config:")
    if args.dataset:
        print(f"  data.sources: [{{hf_name: {args.repo_id}}}]")
        if args.revision:
            print("  (hf_name reads the revision main points to)")
    elif args.revision:  # model.hub_id finds the revision main points to
        print(f"  model.path: {result.snapshot}")
    else:
        print(f"  model.hub_id: {args.repo_id}")
    return 0


def human_size(size: int) -> str:
    """Bytes as a short human number: 812 B, 1.4 MB, 15.2 GB."""
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"
