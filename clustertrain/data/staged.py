"""A staged dataset folder, as `clustertrain stage dataset` writes it: Parquet shards and the manifest that lists them.

    OUT/manifest.json          source, subset, split, revision, text field, limits, per-shard file, sha256,
                               rows, tokens, bytes; `complete` once the stage has ended
    OUT/part-00000.parquet     one `text` column, rows in the source's order
    OUT/part-00001.parquet     ...

A training source `path: OUT` reads the shards the manifest lists, in order, and refuses a partial stage in one
line: shards are added while a stage runs, and a source whose documents change under a run could not resume.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from clustertrain.errors import DataError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "clustertrain-stage/1"
TEXT_COLUMN = "text"


def is_staged(folder: Path) -> bool:
    """Whether `folder` holds a stage manifest (complete or not)."""
    return (folder / MANIFEST).is_file()


def read_manifest(folder: Path) -> dict:
    """The manifest of the stage in `folder`; a DataError naming the file when it is not one."""
    file = folder / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{file}: not a readable stage manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise DataError(f"{file}: not a stage manifest (no \"format\": \"{MANIFEST_FORMAT}\"); written by "
                        "`clustertrain stage dataset`?")
    return manifest


def staged_files(folder: Path) -> list[Path]:
    """The shards of a complete stage in `folder`, in order; a DataError for a partial stage or a shard that is
    missing or not the size the manifest says (sizes only: `clustertrain stage dataset --verify` re-hashes)."""
    manifest = read_manifest(folder)
    shards = manifest.get("shards", [])
    if not manifest.get("complete"):
        rows = sum(shard["rows"] for shard in shards)
        raise DataError(f"data source {str(folder)!r} is a partial stage ({len(shards)} shards, {rows} rows so far): "
                        f"finish it by running `{manifest.get('command', 'clustertrain stage dataset')}` again")
    files = []
    for shard in shards:
        path = folder / shard["file"]
        size = path.stat().st_size if path.is_file() else None
        if size != shard["bytes"]:
            found = "missing" if size is None else f"{size} bytes, not the manifest's {shard['bytes']}"
            raise DataError(f"{path}: {found}; stage {folder} again into an empty folder")
        files.append(path)
    return files


def verify_stage(out: Path) -> list[str]:
    """Each listed shard of the stage in `out` re-hashed: the problems, one line each (none: it matches)."""
    manifest = read_manifest(out)
    problems = [] if manifest.get("complete") else [f"{out}: a partial stage (complete is false)"]
    for shard in manifest["shards"]:
        path = out / shard["file"]
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
        if digest.hexdigest() != shard["sha256"]:
            problems.append(f"{path}: sha256 {digest.hexdigest()[:16]}..., not the manifest's "
                            f"{shard['sha256'][:16]}...")
    return problems
