"""Stage Hugging Face models and datasets in the local HF cache, and find them there again with no network.

A download counts as complete once its manifest exists: each file's size and sha256, written to
`<repo folder>/clustertrain-manifests/<commit>.json` after every file was checked against the hash the hub
named its blob by (sha256 for LFS files, git sha1 for the rest). Later calls compare sizes; `verify` re-hashes.
A download limited by glob patterns (`include`/`exclude`, the hub client's allow/ignore patterns) records
them: a later call with other patterns fetches again, one with the same patterns (or after a full download) does not.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from clustertrain.errors import DataError, first_line
from clustertrain.files import write_atomic

# fetch(repo_id, repo_type, revision, cache, force, include=[...] | None, exclude=[...] | None) -> snapshot
Fetch = Callable[..., Path]
MANIFESTS = "clustertrain-manifests"
_SHA256, _GIT_SHA1 = re.compile(r"[0-9a-f]{64}"), re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class Download:
    """What `download` left in the cache; `reason` says why it fetched, or "already complete"."""

    cache_dir: Path
    snapshot: Path
    files: int
    size_bytes: int
    fetched: bool
    reason: str
    verified: bool
    partial_bytes: int = 0  # of partial files a stopped download had left, removed before this one


def hub_cache(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir`, else the HF hub cache: $HF_HUB_CACHE, else $HF_HOME/hub."""
    from huggingface_hub import constants

    return Path(cache_dir or constants.HF_HUB_CACHE).expanduser()


def download(
    repo_id: str, *, repo_type: str = "model", revision: str | None = None, cache_dir: str | Path | None = None,
    force: bool = False, verify: bool = False, fetch: Fetch | None = None,
    include: list[str] | None = None, exclude: list[str] | None = None,
) -> Download:
    """Fetch `repo_id` into the HF cache unless a complete copy is there; `verify` re-hashes a cached copy.

    `fetch` defaults to the hub (`hub_fetch`); `local_fetch(DIR)` copies a directory instead. `include` and
    `exclude` are glob patterns of the files to fetch or leave out (e.g. `*.bin` where safetensors exist).
    Raises DataError naming each missing or corrupt file.
    """
    cache = hub_cache(cache_dir)
    patterns = {"include": include or None, "exclude": exclude or None}
    snapshot = cached_snapshot(repo_id, repo_type, revision, cache)
    manifest = read_manifest(snapshot) if snapshot else None
    problems = file_problems(snapshot, manifest) if snapshot and manifest else {}
    recorded = read_patterns(snapshot) if manifest else {}
    reason = ("--force" if force else "not in the cache" if snapshot is None
              else "no manifest (an interrupted download, or one by another tool)" if manifest is None
              else f"incomplete: {_listed(problems)}" if problems
              else f"the cached copy holds only {_shown(recorded)}" if any(recorded.values()) and recorded != patterns
              else "")
    partial = 0
    if reason:
        partial = remove_partial_files(cache, repo_id, repo_type)
        for name in problems:  # drop the file and its blob, so that a fetch without --force replaces them
            path = snapshot / name
            if path.is_symlink():
                Path(os.path.realpath(path)).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
        given = {name: globs for name, globs in patterns.items() if globs}
        snapshot = (fetch or hub_fetch)(repo_id, repo_type, revision, cache, force, **given)
        manifest = write_manifest(snapshot, patterns)  # hashes every file: a fresh download is verified here
    elif verify and (problems := file_problems(snapshot, manifest, rehash=True)):
        command = download_command(repo_id, repo_type, revision)
        raise DataError(f"{repo_id} in {snapshot}: {_listed(problems)}; fetch it again with: {command} --force")
    size = sum(entry["size"] for entry in manifest.values())
    fetched = bool(reason)
    return Download(cache, snapshot, len(manifest), size, fetched, reason or "already complete", verify or fetched,
                    partial)


def remove_partial_files(cache: Path, repo_id: str, repo_type: str) -> int:
    """Delete the partial files that stopped downloads of this repo left in its blobs; returns the bytes freed.

    The hub client names each download's partial file uniquely (`<etag>.<random>.incomplete`) and never reuses
    one, so a download killed mid-file leaves it for good. A file whose download still runs, in another
    process, holds the hub client's lock for that blob and is kept.
    """
    from filelock import FileLock, Timeout
    from huggingface_hub.file_download import repo_folder_name

    folder = repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    freed = 0
    for path in sorted((cache / folder / "blobs").glob("*.incomplete")):
        lock = cache / ".locks" / folder / f"{path.name.split('.')[0]}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        try:
            with FileLock(lock, timeout=0):
                size = path.stat().st_size
                path.unlink()
                freed += size
        except (Timeout, OSError):  # being downloaded now, or gone already
            continue
    return freed


def remove_own_partial_files(cache: Path) -> int:
    """Delete the partial files this process is writing into `cache` (found through /proc/self/fd, on Linux;
    elsewhere the next download removes them); returns the bytes freed. For a stop that cannot wait for the
    hub client's download threads to end."""
    freed = 0
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                path = Path(os.readlink(f"/proc/self/fd/{fd}"))
                if path.is_relative_to(cache.resolve()) and (path.suffix == ".incomplete"
                                                             or path.name.startswith(".incoming-")):
                    size = path.stat().st_size
                    path.unlink()
                    freed += size
    return freed


def resolve_hub_id(hub_id: str, cache_dir: str | Path | None = None, revision: str | None = None) -> Path:
    """The local snapshot directory of model `hub_id` in the HF cache, found with no network."""
    cache = hub_cache(cache_dir)
    snapshot = cached_snapshot(hub_id, "model", revision, cache)
    command = download_command(hub_id, "model", revision)
    if snapshot is None:
        raise DataError(f"model.hub_id '{hub_id}'{f' (revision {revision})' if revision else ''} is not in the "
                        f"Hugging Face cache {cache}; fetch it on a login node (with network, same HF_HOME): {command}")
    manifest = read_manifest(snapshot)
    if manifest and (problems := file_problems(snapshot, manifest)):
        raise DataError(f"model.hub_id '{hub_id}': {snapshot} is incomplete ({_listed(problems)}); "
                        f"complete it on a login node: {command}")
    return snapshot


def check_adapter_base(adapter_dir: Path, cache_dir: str | Path | None = None) -> None:
    """Refuse in one line an adapter whose base model is a hub id missing from the local HF cache, before peft
    and transformers look for it (offline they fail with "couldn't connect", online they retry the hub), or a
    base that would need its own Python code to load."""
    from clustertrain.config.remote_code import custom_code

    try:
        base = json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # peft names the problem itself
    if not isinstance(base, str):
        return
    folder = next((Path(where, base).expanduser() for where in (".", adapter_dir)
                   if Path(where, base).expanduser().is_dir()), None)
    cache = hub_cache(cache_dir)
    try:
        folder = folder or cached_snapshot(base, "model", None, cache)
    except DataError:  # not a hub id either: a missing folder, which the loader names
        return
    if folder is None:
        raise DataError(f"{adapter_dir}: its base model '{base}' is neither a folder here nor in the Hugging Face "
                        f"cache {cache}; fetch it on a machine with network (same HF_HOME): {download_command(base)}")
    if problem := custom_code(folder):
        raise DataError(f"{adapter_dir}: its base model {problem}")


def cached_snapshot(repo_id: str, repo_type: str, revision: str | None, cache: Path) -> Path | None:
    """The cached snapshot of `revision` (default main), or None; never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=cache,
                                      local_files_only=True))
    except LocalEntryNotFoundError:
        return None
    except HFValidationError as e:
        raise DataError(f"'{repo_id}' is not a Hugging Face id: {first_line(e)}") from None


def hub_fetch(repo_id: str, repo_type: str, revision: str | None, cache: Path, force: bool,
              include: list[str] | None = None, exclude: list[str] | None = None) -> Path:
    """Download a snapshot with the hub client (its own progress bars); `force` re-downloads every file."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE:
        raise DataError(f"HF_HUB_OFFLINE is set, so {repo_id} cannot be downloaded; unset it on a machine with network")
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=cache,
                                      force_download=force, allow_patterns=include, ignore_patterns=exclude))
    except GatedRepoError:
        problem = "is gated: accept its terms on huggingface.co, then log in with `hf auth login`"
    except RepositoryNotFoundError:
        problem = f"is not a {repo_type} on the hub (private? log in with `hf auth login`; a dataset? --dataset)"
    except OSError as e:  # a missing revision, other HTTP errors, and LocalEntryNotFoundError (no connection)
        problem = f"cannot be downloaded: {first_line(e)}"
    raise DataError(f"{repo_id} {problem}")


def local_fetch(source: str | Path) -> Fetch:
    """A fetch that copies a local directory (a mirror, an air-gapped transfer) into the HF cache layout."""
    source = Path(source).expanduser()
    if not source.is_dir():
        raise DataError(f"--from-dir {source} is not a directory")

    def fetch(repo_id: str, repo_type: str, revision: str | None, cache: Path, force: bool,
              include: list[str] | None = None, exclude: list[str] | None = None) -> Path:
        from huggingface_hub.file_download import repo_folder_name
        from huggingface_hub.utils import filter_repo_objects  # the hub client's own pattern matching

        repo = cache / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
        (repo / "blobs").mkdir(parents=True, exist_ok=True)
        names = [p.relative_to(source).as_posix() for p in sorted(source.rglob("*")) if p.is_file()]
        names = [n for n in names if not n.startswith((".git/", ".cache/"))]
        blobs = {}  # always copied, force or not: hashing the source costs as much as copying it
        for name in filter_repo_objects(names, allow_patterns=include, ignore_patterns=exclude):
            incoming = repo / "blobs" / f".incoming-{os.getpid()}"
            blobs[name] = _sha256(source / name, copy_to=incoming)
            os.replace(incoming, repo / "blobs" / blobs[name])
        commit = revision if _GIT_SHA1.fullmatch(revision or "") else None
        if commit is None:  # a made-up commit id: the same content gives the same snapshot
            commit = hashlib.sha1(json.dumps(blobs, sort_keys=True).encode()).hexdigest()
            ref = repo / "refs" / (revision or "main")
            ref.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(ref, commit)
        for name, blob in blobs.items():
            link = repo / "snapshots" / commit / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.unlink(missing_ok=True)
            link.symlink_to(os.path.relpath(repo / "blobs" / blob, link.parent))
        return repo / "snapshots" / commit

    return fetch


def read_manifest(snapshot: Path) -> dict[str, dict] | None:
    """The manifest of a snapshot ({file: {size, sha256}}), or None when no download of it completed."""
    try:
        return json.loads(_manifest_path(snapshot).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return None


def read_patterns(snapshot: Path) -> dict[str, list[str] | None]:
    """The include/exclude patterns the snapshot's download was limited to ({} or None values: everything)."""
    try:
        return json.loads(_manifest_path(snapshot).read_text()).get("patterns") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def write_manifest(snapshot: Path, patterns: dict[str, list[str] | None] | None = None) -> dict[str, dict]:
    """Hash every file of a fresh snapshot, check it against its blob's name, and record the manifest (with the
    include/exclude patterns the download was limited to)."""
    files, problems = {}, {}
    for path in sorted(p for p in snapshot.rglob("*") if not p.is_dir()):
        name = path.relative_to(snapshot).as_posix()
        if not path.exists():
            problems[name] = "is missing (a broken link)"
            continue
        files[name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
        blob = os.path.basename(os.readlink(path)) if path.is_symlink() else ""
        if (_SHA256.fullmatch(blob) and blob != files[name]["sha256"]
                or _GIT_SHA1.fullmatch(blob) and blob != _git_blob_id(path)):
            problems[name] = "does not match the hash the hub gave"
    if problems:
        raise DataError(f"the download into {snapshot} is corrupt: {_listed(problems)}; fetch it again with --force")
    limited = {"patterns": patterns} if patterns and any(patterns.values()) else {}
    manifest = _manifest_path(snapshot)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(manifest, json.dumps({"files": files, **limited}, indent=1))
    return files


def file_problems(snapshot: Path, manifest: dict[str, dict], rehash: bool = False) -> dict[str, str]:
    """Files of the manifest that are missing or resized (or, with `rehash`, changed): {file: problem}."""
    problems = {}
    for name, expected in manifest.items():
        path = snapshot / name
        if not path.is_file():
            problems[name] = "is missing"
        elif path.stat().st_size != expected["size"]:
            problems[name] = f"has {path.stat().st_size} bytes, expected {expected['size']}"
        elif rehash and _sha256(path) != expected["sha256"]:
            problems[name] = "has a different sha256 than when it was downloaded"
    return problems


def download_command(repo_id: str, repo_type: str = "model", revision: str | None = None) -> str:
    """The `clustertrain download` line that fetches this repo."""
    flags = ["--dataset"] * (repo_type == "dataset") + [f"--revision {revision}"] * bool(revision)
    return " ".join(["clustertrain download", repo_id, *flags])


def _manifest_path(snapshot: Path) -> Path:
    return snapshot.parent.parent / MANIFESTS / f"{snapshot.name}.json"


def _sha256(path: Path, copy_to: Path | None = None) -> str:
    sha256 = hashlib.sha256()
    with path.open("rb") as src, copy_to.open("wb") if copy_to else contextlib.nullcontext() as dst:
        while chunk := src.read(1 << 24):
            sha256.update(chunk)
            if dst:
                dst.write(chunk)
    return sha256.hexdigest()


def _git_blob_id(path: Path) -> str:
    """The id git, and so the hub, gives a file: the sha1 of a header and the content (non-LFS files are small)."""
    return hashlib.sha1(b"blob %d\0" % path.stat().st_size + path.read_bytes()).hexdigest()


def _shown(patterns: dict[str, list[str] | None]) -> str:
    return ", ".join(f"--{flag} {' '.join(globs)}" for flag, globs in patterns.items() if globs)


def _listed(problems: dict[str, str]) -> str:
    return "; ".join(f"{name} {problem}" for name, problem in problems.items())


