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
the source's end is reached; `clustertrain.data.staged` reads it for training.

`max_tokens` counts the tokens training will see: the run's tokenizer (`tokenizer`) encodes each text without
special tokens, plus the EOS that packing appends after each document. Without a tokenizer only `max_rows`
limits a stage, and the manifest records rows and UTF-8 bytes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

from clustertrain.data.readers import check_text, json_type
from clustertrain.data.staged import MANIFEST, MANIFEST_FORMAT, TEXT_COLUMN, is_staged, read_manifest
from clustertrain.errors import DataError, UserError, first_line
from clustertrain.files import write_atomic

CHUNK_ROWS = 1000  # rows read and tokenized at a time
ROW_GROUP_ROWS = 1024  # rows per Parquet row group: training reads a shard a group at a time
FINGERPRINT_BYTES = 1 << 20  # of each local file, its first and last MiB are hashed (with its name and size)
FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv",
                 ".txt": "text", ".arrow": "arrow"}
# What must match for a stage to resume in the same folder (besides the local fingerprint).
IDENTITY = ("source", "subset", "split", "text_field", "max_rows", "max_tokens", "tokenizer", "shard_rows")


@dataclass(frozen=True)
class StageRequest:
    """What to stage: the arguments of `clustertrain stage dataset`."""

    source: str
    out: Path
    subset: str | None = None
    split: str = "train"
    text_field: str = "text"
    max_rows: int | None = None
    max_tokens: int | None = None
    tokenizer: str | None = None
    shard_rows: int = 50_000
    command: str = "clustertrain stage dataset"  # the command line, for the message that says how to finish


@dataclass(frozen=True)
class Origin:
    """Where the rows come from: a hub dataset at a commit (`revision`), or a local path with a fingerprint."""

    kind: str  # "hub" or "local"
    name: str
    revision: str | None = None
    fingerprint: str | None = None


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


def find_origin(source: str) -> Origin:
    """A local path (with its fingerprint) when `source` exists; else a hub id, its revision not yet asked."""
    path = Path(source).expanduser()
    if path.exists():
        return Origin("local", str(path.resolve()), fingerprint=fingerprint(path))
    if source.startswith(("/", ".", "~")) or source.count("/") > 1 or Path(source).suffix in FILE_BUILDERS:
        raise UserError(f"{source}: no such file or directory (give a local dataset path, or a hub id like "
                        "Zyphra/Zyda-2)")
    return Origin("hub", source)


def hub_revision(name: str, *, required: bool = True) -> str | None:
    """The commit sha of hub dataset `name` now; a UserError (or None if not `required`) when the hub says no."""
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(name).sha
    except Exception as e:  # noqa: BLE001 - offline mode, no network, no such repo, gated: all mean "cannot stage"
        if not required:
            return None
        raise UserError(f"hub dataset {name!r}: {first_line(e)} (stage from the hub where it can be reached, e.g. a "
                        "login node; HF_HUB_OFFLINE must not be 1)") from None


def local_files(path: Path) -> list[Path]:
    """The files of a local dataset path, hidden ones left out, in sorted order."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))


def fingerprint(path: Path) -> str:
    """A sha256 over each file's relative name, size, and first and last MiB: a changed, added or removed file
    changes it, without reading terabytes."""
    digest = hashlib.sha256()
    for file in local_files(path):
        size = file.stat().st_size
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            digest.update(f.read(FINGERPRINT_BYTES))
            if size > 2 * FINGERPRINT_BYTES:
                f.seek(size - FINGERPRINT_BYTES)
                digest.update(f.read(FINGERPRINT_BYTES))
    return digest.hexdigest()


def open_stream(origin: Origin, request: StageRequest, state: dict | None = None):
    """The source as a `datasets.IterableDataset`, positioned after `state` (a saved `state_dict()`)."""
    import datasets

    path = Path(origin.name)
    try:
        if origin.kind == "hub":
            stream = datasets.load_dataset(origin.name, request.subset, split=request.split, streaming=True,
                                           revision=origin.revision)
        elif path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
            saved = datasets.load_from_disk(str(path))
            if isinstance(saved, datasets.DatasetDict):
                if request.split not in saved:
                    raise UserError(f"{path}: no split '{request.split}' (splits: {', '.join(saved)})")
                saved = saved[request.split]
            stream = saved.to_iterable_dataset()
        elif path.is_file():
            if path.suffix not in FILE_BUILDERS:
                raise UserError(f"{path}: cannot tell the format from the extension ({', '.join(FILE_BUILDERS)})")
            stream = datasets.load_dataset(FILE_BUILDERS[path.suffix], data_files={request.split: str(path)},
                                           split=request.split, streaming=True)
        else:
            stream = datasets.load_dataset(str(path), request.subset, split=request.split, streaming=True)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds for a bad name, split, subset or file
        raise UserError(f"{request.source}: {first_line(e)}") from None
    features = stream.features  # known from the files or the hub's metadata, or None: then each row is checked
    if features is not None and request.text_field not in features:
        raise UserError(f"{request.source}: its records have no field '{request.text_field}' (fields: "
                        f"{', '.join(features)}); give --text-field")
    if state is not None:
        stream.load_state_dict(state)
    return stream


def texts_of(stream, request: StageRequest, first_row: int) -> Iterator[str]:
    """The text field of each record, checked; a UserError naming the row for one without it."""
    rows = iter(stream)
    index = first_row
    while True:
        try:
            record = next(rows)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - a malformed file surfaces while reading, as any of many kinds
            raise DataError(f"{request.source}: cannot read row {index} ({first_line(e)})") from None
        value = record.get(request.text_field)
        if request.text_field not in record:
            fields = ", ".join(map(str, record)) or "none"
            raise UserError(f"{request.source} row {index}: no field '{request.text_field}' (fields: {fields}); "
                            "give --text-field")
        if not isinstance(value, str):
            raise DataError(f"{request.source} row {index}: field '{request.text_field}' is {json_type(value)}, "
                            "not a string")
        yield check_text(value, f"{request.source} row {index}: field '{request.text_field}'")
        index += 1


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
    from clustertrain.config.schema import DataConfig
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
    out.mkdir(parents=True, exist_ok=True)
    manifest["shards"].append(write_shard(out, len(manifest["shards"]), texts, tokens))
    manifest.update(resume_state=resume_state, complete=ended_by is not None, ended_by=ended_by)
    save_manifest(out, manifest)


def save_manifest(out: Path, manifest: dict) -> None:
    import json

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
    origin = find_origin(request.source)
    manifest = existing_manifest(request, origin)
    if manifest is not None and manifest["complete"]:
        return manifest
    if manifest is None:  # written with the first shard: a stage refused before it leaves no folder behind
        if origin.kind == "hub":
            origin = Origin(origin.kind, origin.name, revision=hub_revision(origin.name))
        manifest = new_manifest(request, origin)
    else:
        origin = Origin(origin.kind, origin.name, manifest["revision"], origin.fingerprint)  # pinned at the start
        remove_unlisted(request.out, manifest)
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
    if not manifest["shards"]:
        raise DataError(f"{request.source}: split '{request.split}' holds no rows")
    if not manifest["complete"]:  # the source ended at a shard's end
        manifest.update(complete=True, ended_by=ended_by, resume_state=None)
        save_manifest(request.out, manifest)
    return manifest


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

