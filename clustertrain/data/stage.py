"""Stream a slice of a dataset (from the hub, or a local path) into Parquet shards with a manifest.

    request = StageRequest(source="HuggingFaceTB/finemath", subset="finemath-4plus", out=Path("data/finemath"),
                           max_tokens=10**9, tokenizer="models/Llama-3.2-1B")
    manifest = stage_dataset(request)     # OUT/part-00000.parquet ..., OUT/manifest.json

The hub and a local path take one road: `datasets.load_dataset(NAME_OR_PATH, subset, split=..., streaming=True)`
(a `save_to_disk` folder: `load_from_disk(...).to_iterable_dataset()`), read in the source's order, never whole.
A hub dataset is pinned to the commit its `dataset_info` names when the stage starts; a local one is recorded by
path and a content fingerprint. Each shard goes to a hidden temporary file, is renamed into place, then listed in
the manifest together with the stream's position after it (`IterableDataset.state_dict()`); the manifest is
replaced atomically. A stage killed at any moment resumes after its last listed shard (unlisted files are removed),
and its shards and checksums equal those of a stage never stopped. The manifest says `complete` once a limit or
the source's end is reached; `clustertrain.data.staged` reads it for training. The rows come from
`clustertrain.data.stage_source`.

`max_tokens` counts the tokens training will see: the run's tokenizer (`tokenizer`) encodes each text without
special tokens, plus the EOS that packing appends after each document. Without a tokenizer only `max_rows`
limits a stage, and the manifest records rows and UTF-8 bytes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from collections.abc import Callable
from dataclasses import asdict
from itertools import islice
from pathlib import Path

from clustertrain.data.stage_source import (Origin, StageRequest, find_origin, hub_revision, local_files,
                                            open_stream, texts_of)
from clustertrain.data.staged import MANIFEST, MANIFEST_FORMAT, TEXT_COLUMN, is_staged, read_manifest
from clustertrain.errors import DataError, ExitCode, UserError
from clustertrain.files import write_atomic

CHUNK_ROWS = 1000  # rows read and tokenized at a time
ROW_GROUP_ROWS = 1024  # rows per Parquet row group: training reads a shard a group at a time
NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}  # the user's choice of folder: exit 2
NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # exit 74, as a checkpoint save or an export onto a full disk
# What must match for a stage to resume in the same folder (besides the local fingerprint).
IDENTITY = ("source", "subset", "split", "text_field", "max_rows", "max_tokens", "tokenizer", "shard_rows")


class StageWriteFailed(DataError):
    """The disk or the quota filled while staging: exit 74 (EX_IOERR), as for a failed checkpoint save or export."""

    exit_code = ExitCode.SAVE_FAILED


@contextlib.contextmanager
def writing(out: Path):
    """Writes into `out` that the OS refuses as one line: exit 2 for a folder that cannot be written, 74 for a full
    disk or quota. The shards the manifest lists, and the manifest, are left as they were: a rerun resumes."""
    try:
        yield
    except OSError as e:
        if e.errno not in NOT_WRITABLE | NO_SPACE:
            raise
        for tmp in out.glob(".part-*"):  # the failed shard: its space back
            with contextlib.suppress(OSError):
                tmp.unlink()
        reason = os.strerror(e.errno).lower()  # pyarrow's own text is long, and it names no file
        if e.errno in NOT_WRITABLE:
            raise DataError(f"cannot write {out}: {reason}; stage into a folder you can write to (the shards "
                            f"{MANIFEST} lists are kept: the same command resumes after them)") from None
        raise StageWriteFailed(f"writing {out} failed: {reason}; the shards {out / MANIFEST} lists are intact: free "
                               "space and run the same command again to resume after them") from None


def check_request(request: StageRequest) -> None:
    """A UserError for flags that do not go together."""
    if request.max_rows is not None and request.max_tokens is not None:
        raise UserError("give --max-tokens or --max-rows, not both")
    if request.max_tokens is not None and not request.tokenizer:
        raise UserError("--max-tokens counts the run's tokens: give --tokenizer PATH (the run's data.tokenizer), "
                        "or limit rows with --max-rows")
    for flag, value in (("--max-rows", request.max_rows), ("--max-tokens", request.max_tokens),
                        ("--shard-rows", request.shard_rows)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be a positive number, not {value}")


def new_manifest(request: StageRequest, origin: Origin) -> dict:
    """The manifest of a stage that has not begun."""
    fields = asdict(request)
    identity = {key: fields[key] for key in IDENTITY}
    identity["source"] = origin.name  # a local path resolved: the same folder however it was spelled
    if request.tokenizer:
        identity["tokenizer"] = str(Path(request.tokenizer).expanduser().resolve())
    return {"format": MANIFEST_FORMAT, **identity, "origin": origin.kind, "revision": origin.revision,
            "fingerprint": origin.fingerprint, "command": request.command, "column": TEXT_COLUMN, "shards": [],
            "complete": False, "ended_by": None, "resume_state": None}


def existing_manifest(request: StageRequest, origin: Origin) -> dict | None:
    """The manifest of the stage already in OUT, if it is this one; a UserError if OUT holds something else."""
    out = request.out
    if not out.exists():
        return None
    if not out.is_dir():
        raise UserError(f"{out}: exists and is not a folder; give a new or empty folder for the shards")
    if not is_staged(out):
        if any(not path.name.startswith(".part-") for path in out.iterdir()):  # a first shard's temporary file
            raise UserError(f"{out}: not empty and holds no {MANIFEST}; give a new or empty folder for the shards")
        return None
    manifest = read_manifest(out)
    wanted = new_manifest(request, origin)
    for key in (*IDENTITY, "fingerprint"):
        if manifest.get(key) != wanted[key]:
            what = "a local source that has changed since" if key == "fingerprint" else \
                f"{key} {manifest.get(key)!r}, not {wanted[key]!r}"
            raise UserError(f"{out} holds a stage of {manifest.get('source')} with {what}: give another folder, or "
                            "remove it to stage again")
    return manifest


def remove_unlisted(out: Path, manifest: dict) -> None:
    """Remove shards a killed stage wrote but never listed, and its temporary files."""
    listed = {shard["file"] for shard in manifest["shards"]}
    with writing(out):
        for path in out.glob("part-*.parquet"):
            if path.name not in listed:
                path.unlink()
        for path in out.glob(".part-*"):
            path.unlink()
    for shard in manifest["shards"]:
        path = out / shard["file"]
        if not path.is_file() or path.stat().st_size != shard["bytes"]:
            raise UserError(f"{path}: missing or not the size {MANIFEST} lists; remove {out} to stage again")


def token_counts(tokenizer, texts: list[str]) -> list[int] | None:
    """Tokens training sees per text: its ids without special tokens, plus the EOS packing appends."""
    if tokenizer is None:
        return None
    if not texts:  # the source's end: a fast tokenizer fails on an empty batch
        return []
    ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return [len(one) + 1 for one in ids]


def run_tokenizer(path: str | None):
    """The tokenizer in folder `path` as a run loads it (its checks included), or None."""
    if not path:
        return None
    from clustertrain.config.data_schema import DataConfig
    from clustertrain.data.tokenize import load_tokenizer

    try:
        return load_tokenizer(DataConfig(tokenizer=path))
    except DataError as e:
        raise DataError(str(e).replace("data.tokenizer:", "--tokenizer:", 1)) from None


def rows_within(counts: list[int], left: int) -> int | None:
    """How many of the rows with these token counts a budget of `left` tokens takes, the row that reaches it
    included; None if it takes them all and has tokens left."""
    for end, count in enumerate(counts, 1):
        left -= count
        if left <= 0:
            return end
    return None


def write_shard(out: Path, number: int, texts: list[str], tokens: int | None) -> dict:
    """Write shard `number` through a hidden temporary file; its manifest entry."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = f"part-{number:05d}.parquet"
    tmp = out / f".{name}.tmp"
    pq.write_table(pa.table({TEXT_COLUMN: pa.array(texts, pa.string())}), tmp, row_group_size=ROW_GROUP_ROWS)
    digest = hashlib.sha256()
    with open(tmp, "rb+") as f:
        while block := f.read(1 << 22):
            digest.update(block)
        os.fsync(f.fileno())
    size = tmp.stat().st_size
    os.replace(tmp, out / name)
    return {"file": name, "sha256": digest.hexdigest(), "rows": len(texts), "tokens": tokens, "bytes": size,
            "text_bytes": sum(len(t.encode()) for t in texts)}


def list_shard(out: Path, manifest: dict, texts: list[str], tokens: int | None, resume_state: dict | None,
               ended_by: str | None) -> None:
    """Write the next shard, then list it in the manifest with the stream's position after it (None and
    `ended_by` for the last one)."""
    with writing(out):
        out.mkdir(parents=True, exist_ok=True)
        shard = write_shard(out, len(manifest["shards"]), texts, tokens)
    manifest["shards"].append(shard)
    manifest.update(resume_state=resume_state, complete=ended_by is not None, ended_by=ended_by)
    save_manifest(out, manifest)


def save_manifest(out: Path, manifest: dict) -> None:
    import json

    with writing(out):
        write_atomic(out / MANIFEST, json.dumps(manifest, indent=1) + "\n", durable=True)


def totals(manifest: dict) -> tuple[int, int | None]:
    """(rows, tokens) of the listed shards; tokens None without a tokenizer."""
    shards = manifest["shards"]
    tokens = None if manifest["tokenizer"] is None else sum(s["tokens"] for s in shards)
    return sum(s["rows"] for s in shards), tokens


def stage_dataset(request: StageRequest, *, progress: Callable[[int, int | None, int], None] | None = None,
                  on_shard: Callable[[dict], None] | None = None) -> dict:
    """Stage `request` into `request.out`, or finish a stage a stop left there; returns the final manifest.

    Args:
        progress: called after each chunk read with (rows, tokens or None, shards) so far.
        on_shard: called with the manifest after each shard is listed.
    """
    check_request(request)
    origin, manifest = start_point(request)
    if manifest["complete"]:
        return manifest
    ended_by = write_shards(request, origin, manifest, progress, on_shard)
    if not manifest["shards"]:
        raise DataError(f"{request.source}: split '{request.split}' holds no rows")
    if not manifest["complete"]:  # the source ended at a shard's end
        manifest.update(complete=True, ended_by=ended_by, resume_state=None)
        save_manifest(request.out, manifest)
    return manifest


def start_point(request: StageRequest) -> tuple[Origin, dict]:
    """The source, pinned, and the manifest to go on from: the one a stopped stage left in `request.out` (its
    shards that were never listed removed), or a new one, written with the first shard (so that a stage refused
    before it leaves no folder behind)."""
    origin = find_origin(request.source)
    manifest = existing_manifest(request, origin)
    if manifest is None:
        if origin.kind == "hub":
            origin = Origin(origin.kind, origin.name, revision=hub_revision(origin.name))
        return origin, new_manifest(request, origin)
    if not manifest["complete"]:
        origin = Origin(origin.kind, origin.name, manifest["revision"], origin.fingerprint)  # pinned at the start
        remove_unlisted(request.out, manifest)
    return origin, manifest


def write_shards(request: StageRequest, origin: Origin, manifest: dict,
                 progress: Callable[[int, int | None, int], None] | None, on_shard: Callable[[dict], None] | None
                 ) -> str:
    """Read the source from where `manifest` ends and list each shard in it as it is written, until a limit
    (max_rows, max_tokens) or the source's end; returns which of them ended the stage."""
    tokenizer = run_tokenizer(request.tokenizer)
    rows, tokens = totals(manifest)
    stream = open_stream(origin, request, manifest["resume_state"])
    texts = texts_of(stream, request, rows)
    shard_texts: list[str] = []
    shard_tokens = 0
    ended_by = None
    while ended_by is None:
        wanted = min(CHUNK_ROWS, request.shard_rows - len(shard_texts))
        if request.max_rows is not None:
            wanted = min(wanted, request.max_rows - rows - len(shard_texts))
        chunk = list(islice(texts, wanted))
        counts = token_counts(tokenizer, chunk)
        if counts is not None and request.max_tokens is not None:
            end = rows_within(counts, request.max_tokens - (tokens or 0) - shard_tokens)
            if end is not None:
                chunk, counts, ended_by = chunk[:end], counts[:end], "max_tokens"
        shard_texts += chunk
        shard_tokens += sum(counts or [])
        if ended_by is None and request.max_rows == rows + len(shard_texts):
            ended_by = "max_rows"
        elif ended_by is None and len(chunk) < wanted:
            ended_by = "end of source"
        if progress:
            progress(rows + len(shard_texts), None if tokens is None else tokens + shard_tokens,
                     len(manifest["shards"]))
        if shard_texts and (len(shard_texts) == request.shard_rows or ended_by):
            # the stream has yielded exactly these rows: its position is where a resumed stage goes on
            list_shard(request.out, manifest, shard_texts, shard_tokens if tokenizer else None,
                       None if ended_by else stream.state_dict(), ended_by)
            rows, tokens = totals(manifest)
            shard_texts, shard_tokens = [], 0
            if on_shard:
                on_shard(manifest)
    return ended_by


def describe_stage(request: StageRequest) -> list[str]:
    """What `stage_dataset(request)` would fetch and write, as lines; nothing is written."""
    check_request(request)
    origin = find_origin(request.source)
    manifest = existing_manifest(request, origin)
    if origin.kind == "hub":
        revision = manifest["revision"] if manifest else hub_revision(origin.name, required=False)
        where = f"hub dataset {origin.name} at revision {revision or 'unknown (the hub cannot be reached)'}"
    else:
        files = local_files(Path(origin.name))
        where = f"local dataset {origin.name} ({len(files)} files, fingerprint {origin.fingerprint[:16]})"
    limit = (f"the first {request.max_rows:,} rows" if request.max_rows else
             f"rows until {request.max_tokens:,} tokens ({request.tokenizer}, with EOS)" if request.max_tokens else
             "every row")
    lines = [f"source: {where}", f"subset: {request.subset or '(default)'}, split: {request.split}, text field: "
             f"{request.text_field}", f"limit: {limit}",
             f"output: {request.out}/part-NNNNN.parquet, {request.shard_rows:,} rows a shard, and {MANIFEST}"]
    if manifest is not None:
        rows, _ = totals(manifest)
        state = "complete: nothing to fetch" if manifest["complete"] else "partial: would resume after it"
        lines.append(f"{request.out} holds {len(manifest['shards'])} shards, {rows:,} rows of this stage ({state})")
    return lines
