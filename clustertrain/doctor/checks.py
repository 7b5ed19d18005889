"""What `clustertrain doctor` checks on one rank without talking to the others: the environment the config implies,
the files it reads, the disk it writes. Each check returns Findings; a failed one says in one line what to do.

    environment(config.slurm, os.environ)       # the preset's variables, on the preset's cluster
    rccl_plugin("/path/aws-ofi-rccl")           # librccl-net*.so loads
    snapshot(Path("models/llama"), hub_id=None) # config.json and every weight file its index names
    disk(Path("runs/x"), needed_bytes=3e9)      # free space for the checkpoints the run keeps
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from clustertrain.config.data_schema import DataConfig, SourceConfig

from clustertrain.config.schema import RunConfig
from clustertrain.config.slurm_schema import SlurmConfig
from clustertrain.errors import UserError, first_line


@dataclass(frozen=True)
class Finding:
    """One check's result on one rank: `detail` says what was found, and on a failure what to do."""

    check: str
    ok: bool
    detail: str


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def environment(slurm: SlurmConfig, environ: Mapping[str, str], config_path: str | None) -> list[Finding]:
    """The variables the preset (and slurm.env) sets, on the preset's cluster (launch.slurm.environment_problems)."""
    from clustertrain.launch.presets import load_preset, on_cluster
    from clustertrain.launch.slurm import environment_problems

    if not on_cluster(load_preset(slurm.preset), environ):
        where = environ.get("SLURM_CLUSTER_NAME", "no SLURM_CLUSTER_NAME")
        return [Finding("environment", True, f"not on the {slurm.preset} preset's cluster ({where}): its variables "
                        "are not compared")]
    how = f'eval "$(clustertrain env{" " + config_path if config_path else ""})" in an salloc shell sets them all'
    if problems := environment_problems(slurm, environ):
        return [Finding("environment", False, f"{p} ({how})") for p in problems]
    return [Finding("environment", True, f"as the {slurm.preset} preset sets it")]


def rccl_plugin(prefix: str) -> Finding:
    """The aws-ofi-rccl plugin (RCCL's network over libfabric) loads from `prefix`/lib: without it RCCL falls back
    to TCP sockets, an order of magnitude slower across nodes."""
    libs = sorted(Path(prefix, "lib").glob("librccl-net*.so*"))
    if not libs:
        return Finding("rccl plugin", False, f"no librccl-net*.so in {prefix}/lib: build aws-ofi-rccl (see the OLCF "
                       "PyTorch page) and set slurm.env.AWS_OFI_RCCL_DIR to its prefix")
    try:
        ctypes.CDLL(str(libs[0]))
    except OSError as e:
        return Finding("rccl plugin", False, f"{libs[0]} does not load ({first_line(e)}): rebuild it against the "
                       "loaded rocm and libfabric modules, or fix slurm.env.AWS_OFI_RCCL_DIR")
    return Finding("rccl plugin", True, f"{libs[0]} loads")


def miopen_cache(path: str) -> Finding:
    """MIOpen's cache directory (MIOPEN_USER_DB_PATH) can be made and written: its default in $HOME fails under
    many ranks."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        return Finding("miopen cache", False, f"MIOPEN_USER_DB_PATH={path} is not writable ({e.strerror or e}): "
                       "point it at node-local /tmp, as the frontier preset does")
    return Finding("miopen cache", True, f"{path} is writable")


def hf_offline(environ: Mapping[str, str]) -> Finding:
    """The Hugging Face libraries stay off the network (compute nodes have none: a lookup hangs, then fails)."""
    value = environ.get("HF_HUB_OFFLINE", "")
    if value.lower() in ("1", "true", "yes", "on"):
        return Finding("hf offline", True, f"HF_HUB_OFFLINE={value}")
    return Finding("hf offline", False, f"HF_HUB_OFFLINE={value or '(unset)'}: compute nodes have no network; "
                   "unset it (clustertrain then sets 1) or set HF_HUB_OFFLINE=1, and download first")


def snapshot(path: Path, hub_id: str | None) -> Finding:
    """The model snapshot is complete: config.json, every weight file its index names (or the single file), and
    the sizes `clustertrain download` recorded."""
    from clustertrain.model.download import download_command, file_problems, read_manifest

    fix = f"download it again: {download_command(hub_id)}" if hub_id else "copy the model directory again"
    names = [] if (path / "config.json").is_file() else ["config.json"]
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = path / index_name
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                return Finding("model snapshot", False, f"{index} is not a weight index ({first_line(e)}): {fix}")
            names += [f for f in files if not (path / f).is_file()]
            break
        if (path / single).is_file():
            break
    else:
        names.append("model.safetensors")
    problems = {name: "is missing" for name in names}
    if not problems and (manifest := read_manifest(path)):
        problems = file_problems(path, manifest)
    if problems:
        listed = "; ".join(f"{name} {problem}" for name, problem in sorted(problems.items())[:3])
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        return Finding("model snapshot", False, f"{path}: {listed}{more}: {fix}")
    return Finding("model snapshot", True, f"{path} is complete")


def tokenizer(data: DataConfig) -> Finding:
    """The tokenizer loads (a configured one), or will be trained at the first start (none configured)."""
    from clustertrain.data.tokenize import load_tokenizer, tokenizer_dir

    if data.mode == "random" and not data.tokenizer:
        return Finding("tokenizer", True, "none needed (data.mode random)")
    path = tokenizer_dir(data)
    if not data.tokenizer and not (path / "tokenizer.json").is_file():
        return Finding("tokenizer", True, f"none yet: the first start trains one on the sources into {path}")
    try:
        load_tokenizer(data)
    except UserError as e:
        return Finding("tokenizer", False, f"{e}: fix data.tokenizer, or download the model again")
    return Finding("tokenizer", True, f"{path} loads")


def data_sources(data: DataConfig) -> list[Finding]:
    """Every training and held-out source opens and its first record parses."""
    sources = [("data.sources", data.sources), ("data.eval_sources", data.eval_sources or [])]
    return [_source(f"{key}[{i}]", source, data) for key, group in sources for i, source in enumerate(group)]


def _source(key: str, source: SourceConfig, data: DataConfig) -> Finding:
    from clustertrain.data.sources import open_source, resolve_files
    from clustertrain.data.tokenize import cache_root

    name = source.path or source.hf_name or source.format
    try:
        if source.format == "stdlib":
            return Finding("data", True, f"{key}: the standard library")
        if source.format == "tokens" or (source.path and resolve_files(source.path, source.format)[0] == "tokens"):
            files = resolve_files(source.path or "", source.format)[1]
            for file in files:
                with open(file, "rb") as f:
                    f.read(1)
            return Finding("data", True, f"{key}: {name}, {len(files)} token files readable")
        opened = open_source(source, on_bad_data=data.on_bad_data, cache_dir=cache_root(data))
        next(iter(opened.read(0, 1)), None)
    except (UserError, OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e)
        return Finding("data", False, f"{key}: {reason}: fix the path, or copy the data onto this node")
    return Finding("data", True, f"{key}: {name}, {len(opened):,} documents, the first parses")


def checkpoint_bytes(config: RunConfig) -> int:
    """An upper bound of one checkpoint's size, from the model's parameter count on the meta device: 12 bytes per
    trained parameter (float32 weight and AdamW's two moments), 4 per frozen one, which a LoRA run does not save."""
    from clustertrain.model.build import build_hf_config, build_meta_model

    hf_config = build_hf_config(config.model, None, config.data.vocab_size)
    model = build_meta_model(hf_config, config.lora)
    params = {id(p): p for p in model.parameters()}.values()
    trained = sum(p.numel() for p in params if p.requires_grad)
    frozen = 0 if config.lora.enabled else sum(p.numel() for p in params if not p.requires_grad)
    return 12 * trained + 4 * frozen


def kept_checkpoints(config: RunConfig) -> int:
    """How many checkpoints the run holds at once: checkpoint.keep_last, and one more while it writes the next
    (every save, when keep_last is unset)."""
    every, steps, keep = config.checkpoint.every, config.train.steps, config.checkpoint.keep_last
    saves = (steps // every if every and steps else 0) + 1
    return min(keep + 1, saves) if keep else saves


def disk(run_dir: Path, needed: int, what: str) -> Finding:
    """Free space where the run writes, against `needed` bytes (`what` says what they are)."""
    where = Path(run_dir).resolve()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < needed:
        return Finding("disk", False, f"{_gb(free)} free at {where}, {what} need {_gb(needed)}: free space, lower "
                       "checkpoint.keep_last, or point train.run_dir at a larger file system")
    return Finding("disk", True, f"{_gb(free)} free at {where}; {what} need {_gb(needed)}")


def device_memory(device: str, free: int, planned_peak: float) -> Finding:
    """The device's free memory against the plan's peak per rank (`clustertrain plan`)."""
    if free < planned_peak:
        return Finding("device memory", False, f"{device} has {_gb(free)} free, the plan's peak is "
                       f"{_gb(planned_peak)}: another process holds it (nvidia-smi, rocm-smi), or change the layout "
                       "(clustertrain plan --search)")
    return Finding("device memory", True, f"{device}: {_gb(free)} free, plan peak {_gb(planned_peak)}")


def local_checks(config: RunConfig, config_path: str | None, environ: Mapping[str, str] = os.environ,
                 files: bool = True) -> list[Finding]:
    """The checks of one rank; `files` (one rank per node): the snapshot, tokenizer, data and disk too."""
    found = [*environment(config.slurm, environ, config_path), hf_offline(environ)]
    if environ.get("AWS_OFI_RCCL_DIR"):
        found.append(rccl_plugin(environ["AWS_OFI_RCCL_DIR"]))
    if environ.get("MIOPEN_USER_DB_PATH"):
        found.append(miopen_cache(environ["MIOPEN_USER_DB_PATH"]))
    if not files:
        return found
    if config.model.path or config.model.hub_id:
        from clustertrain.model.build import snapshot_dir

        try:
            path = snapshot_dir(config.model)
        except UserError as e:
            found.append(Finding("model snapshot", False, str(e)))
        else:
            found.append(snapshot(path, config.model.hub_id))
    found += [tokenizer(config.data), *data_sources(config.data)]
    count = kept_checkpoints(config)
    with contextlib.suppress(UserError):  # a model that cannot be built has been reported by the config's checks
        size = checkpoint_bytes(config)
        found.append(disk(Path(config.run_dir), count * size, f"{count} checkpoints of up to {_gb(size)}"))
    return found
