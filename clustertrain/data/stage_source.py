"""The rows a stage reads: a hub dataset or a local path through `datasets` streaming, where they come from (a
hub commit, a local fingerprint), and a record that cannot be read named by its file and line."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from clustertrain.data.readers import check_json_lines, check_text
from clustertrain.errors import DataError, UserError, first_line
from clustertrain.files import json_type

FINGERPRINT_BYTES = 1 << 20  # of each local file, its first and last MiB are hashed (with its name and size)
FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv",
                 ".txt": "text", ".arrow": "arrow"}


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
    rows = quietly(iter(stream))
    index = first_row
    while True:
        try:
            record = next(rows)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - a malformed file surfaces while reading, as any of many kinds
            find_bad_line(Path(request.source))  # Arrow's JSON reader names neither the file nor the line
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


def quietly(rows: Iterator[dict]) -> Iterator[dict]:
    """`rows`, read with `datasets`' logger silent: its log of a file it cannot parse would be a second line beside
    ours, which names the file and line."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield from rows
    finally:
        logger.setLevel(level)


def find_bad_line(source: Path) -> None:
    """A DataError naming the file and line of the first malformed record in the JSON files of a local source
    (in order), if it has one."""
    if source.exists():
        for file in local_files(source):
            if FILE_BUILDERS.get(file.suffix) == "json":
                check_json_lines(file)
