"""Convert between training checkpoints (DCP folders) and Hugging Face model directories, on one CPU process.

    clustertrain export runs/tiny-llama/checkpoints/step-0000300 exports/tiny-llama
    clustertrain export runs/lora-sft exports/merged --merge --dtype bf16
    clustertrain import exports/tiny-llama runs/imported/checkpoints/step-0000000

Export streams: it holds one tensor at a time, written in the dtype asked for (`--dtype`, default the run's
`parallel.param_dtype`). Import holds the model once in fp32. Neither needs a process group, and optimizer
state is never read (export) or written (import).
"""

from __future__ import annotations

import copy
import errno
import os
import pickle
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel
from transformers.utils.hub import convert_file_size_to_int

from clustertrain.checkpoint.base import check_base
from clustertrain.checkpoint.compat import write_legacy_config, write_portable_tokenizer_class
from clustertrain.checkpoint.dcp import STEP_DIR, latest_checkpoint, list_checkpoints
from clustertrain.checkpoint.load import with_hint
from clustertrain.checkpoint.reader import (DamagedCheckpoint, OpenedCheckpoint, check_fits, load_state,
                                            open_checkpoint)
from clustertrain.checkpoint.stream import (Snapshot, check_checkpoint_fits, load_adapters, plan_entries,
                                            write_adapter, write_weights)
from clustertrain.checkpoint.train_state import TRAIN_STATE, TrainState
from clustertrain.config.data_schema import DataConfig
from clustertrain.config.load import dump_config, load_config, validate
from clustertrain.config.remote_code import custom_code
from clustertrain.config.schema import RunConfig
from clustertrain.data.tokenize import open_tokenizer
from clustertrain.errors import CheckpointError, ExitCode, first_line
from clustertrain.files import write_atomic
from clustertrain.model.build import build_hf_config, build_meta_model
from clustertrain.model.spec import model_config_problems
from clustertrain.model.weights import init_weights, load_pretrained, refusal
from clustertrain.run_dir import RunDir

# Config fields that describe the file rather than the model; they never go into model.config.
_FILE_FIELDS = {"architectures", "dtype", "torch_dtype", "transformers_version", "model_type", "auto_map"}
# Always recorded: the model needs them even where they equal the arch's defaults, because otherwise
# build_hf_config would take them from the tokenizer.
_PINNED_FIELDS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint folder: `path` itself, or the newest one of a run directory."""
    path = Path(path)
    if (path / TRAIN_STATE).is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    newest = latest_checkpoint(RunDir(path).checkpoints)
    if newest is not None:
        return newest
    raise CheckpointError(f"{path} is not a complete clustertrain checkpoint (no {TRAIN_STATE}) nor a run with one")


@dataclass
class Checkpoint:
    """What an export or a load needs of a checkpoint before any tensor is read."""

    path: Path
    opened: OpenedCheckpoint
    config: RunConfig
    hf_config: PretrainedConfig
    tokenizer: Any
    base: Path | None  # the snapshot of a LoRA checkpoint's frozen base, checked; None: all weights are in it

    @property
    def train_dtype(self) -> torch.dtype:
        """The run's compute dtype (`parallel.param_dtype`): its frozen LoRA base was stored in it. A run records
        the dtype it resolved; "auto" is left only by `clustertrain import`, which stores fp32."""
        dtype = self.config.parallel.param_dtype
        return torch.float32 if dtype == "auto" else getattr(torch, dtype)

    def meta_model(self) -> nn.Module:
        """The checkpoint's model on the meta device, LoRA-wrapped if it was, its frozen base in the train dtype."""
        return build_meta_model(self.hf_config, self.config.lora, self.train_dtype)


def open_for_export(ckpt_dir: str | Path) -> Checkpoint:
    """Check a checkpoint (a `step-N/` folder or a run directory's newest) and read its config and tokenizer.

    Raises:
        CheckpointError: one line: the checkpoint is damaged or incomplete, or a LoRA checkpoint's base is missing
            or is not the snapshot it was trained on.
    """
    path = resolve_checkpoint(ckpt_dir)
    try:
        opened = open_checkpoint(path)
    except DamagedCheckpoint as e:
        raise with_hint(str(e), path, resume=False) from None
    if not (path / "config.yaml").is_file():
        raise CheckpointError(f"{path}: no config.yaml, so the model cannot be rebuilt")
    config = load_config(path / "config.yaml", checks=(model_config_problems,))
    _refuse_custom_code(path / "tokenizer", path / "model")
    tokenizer = None
    if (path / "tokenizer").is_dir():
        tokenizer = open_tokenizer(path / "tokenizer")  # saved by the run, under either transformers major
    if config.model.pretrained:  # the snapshot's HF config, saved with the checkpoint: no snapshot needed
        hf_config = AutoConfig.from_pretrained(path / "model", local_files_only=True, trust_remote_code=False)
    else:  # An imported model pins its vocab_size, which may be below data.vocab_size's floor.
        vocab_size = config.model.config.get("vocab_size", config.data.vocab_size)
        hf_config = build_hf_config(config.model, tokenizer, vocab_size)
    base = opened.train_state.base
    base_dir = check_base(base, path) if base else None
    return Checkpoint(path, opened, config, hf_config, tokenizer, base_dir)


def load_checkpoint_model(ckpt_dir: str | Path) -> tuple[PreTrainedModel, Any, RunConfig]:
    """Build the checkpoint's model on CPU in fp32 and load its weights, without a process group.

    A LoRA checkpoint that holds only its adapters gets its frozen base from the snapshot it refers to, rounded
    to the run's compute dtype as training stored it.

    Args:
        ckpt_dir: a `step-NNNNNNN/` folder, or a run directory (its newest complete checkpoint).

    Returns:
        (model in eval mode, tokenizer or None, the run's resolved config).
    """
    ckpt = open_for_export(ckpt_dir)
    model = ckpt.meta_model()
    init_weights(model, torch.device("cpu"), seed=0)  # also fills non-persistent buffers (rotary tables)
    if ckpt.base is not None:
        load_pretrained(model, ckpt.base)
    options = StateDictOptions(ignore_frozen_params=ckpt.base is not None, strict=ckpt.base is None)
    state = {"model": get_model_state_dict(model, options=options)}
    check_fits(ckpt.path, ckpt.opened.metadata, state)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        try:
            load_state(state, ckpt.path, ckpt.opened.metadata)
        except DamagedCheckpoint as e:
            raise with_hint(str(e), ckpt.path, resume=False) from None
    set_model_state_dict(model, state["model"], options=options)
    return model.float().eval(), ckpt.tokenizer, ckpt.config


def export_hf(ckpt_dir: str | Path, out_dir: str | Path, max_shard_size: str | int = "2GB",
              merge: bool = False, dtype: torch.dtype | None = None) -> Path:
    """Write a checkpoint as a Hugging Face directory, with its tokenizer, streaming one shard at a time.

    A full model gives config, safetensors and generation config. A LoRA run gives its adapter in peft's
    format (`adapter_config.json` naming the base snapshot's absolute path, `adapter_model.safetensors`), or with
    `merge` the full model with the adapter merged into the base weights, layer by layer. `dtype` (default: the
    run's `parallel.param_dtype`) is the dtype of every written tensor. The whole model is never held in memory:
    see `clustertrain.checkpoint.stream`.

    Returns:
        `out_dir`, loadable with `AutoModelForCausalLM.from_pretrained(out_dir)` (full or merged) or
        `peft.PeftModel.from_pretrained(base_model, out_dir)` (adapter).
    """
    from clustertrain.lora import is_lora

    out_dir = Path(out_dir)
    refuse_non_empty(out_dir)
    refuse_checkpoints_folder(out_dir)
    ckpt = open_for_export(ckpt_dir)
    dtype = dtype or ckpt.train_dtype
    if isinstance(max_shard_size, str):
        max_shard_size = convert_file_size_to_int(max_shard_size)
    model = ckpt.meta_model()
    metadata = ckpt.opened.metadata
    check_checkpoint_fits(ckpt.path, metadata, model, base_elsewhere=ckpt.base is not None)
    lora = is_lora(model)
    if merge and not lora:
        raise CheckpointError(f"--merge: {ckpt.path} is not a LoRA run, so there is no adapter to merge; "
                              "export it without --merge (the full model)")

    def write(folder: Path) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            adapters = load_adapters(model, ckpt.path, metadata) if lora else {}
            if lora and not merge:
                write_adapter(model, adapters, folder, dtype, _base_path(ckpt))
            else:
                hf_model = model.get_base_model() if lora else model
                snapshot = Snapshot(ckpt.base, hf_model.base_model_prefix) if ckpt.base else None
                entries = plan_entries(model, metadata, merge=lora)
                write_weights(entries, folder, dtype, max_shard_size, ckpt.path, metadata, snapshot, ckpt.train_dtype)
                _write_config(hf_model, folder, dtype)
        if ckpt.tokenizer is not None:
            ckpt.tokenizer.save_pretrained(folder)
            write_portable_tokenizer_class(folder)

    try:
        publish_folder(out_dir, write)
    except DamagedCheckpoint as e:  # a shard found unreadable as it was read
        raise with_hint(str(e), ckpt.path, resume=False) from None
    return out_dir


def _write_config(model: PreTrainedModel, folder: Path, dtype: torch.dtype) -> None:
    """config.json (with the 4.x keys too) and generation_config.json, as save_pretrained writes them."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    config.save_pretrained(folder)
    write_legacy_config(folder)
    model.generation_config.save_pretrained(folder)


def _base_path(ckpt: Checkpoint) -> str:
    """Where an adapter's base is: the snapshot's absolute path (from any directory), else the run's hub id."""
    if ckpt.base is not None:
        return str(ckpt.base.resolve())
    if ckpt.config.model.path:
        return str(Path(ckpt.config.model.path).resolve())
    return ckpt.config.model.hub_id


def import_hf(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a local Hugging Face model directory as a clustertrain checkpoint folder (weights only, step 0).

    Returns:
        `out_dir`, a weights-only checkpoint for `load_checkpoint_model`, or a start for `train.resume`.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    refuse_non_empty(out_dir)
    _refuse_custom_code(hf_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32,
                                                     trust_remote_code=False)
    except pickle.UnpicklingError as e:  # transformers reads .bin files weights-only
        files = ", ".join(str(f) for f in sorted(hf_dir.glob("*.bin"))) or str(hf_dir)
        raise CheckpointError(f"{files} holds code or non-tensor objects ({refusal(e)}) and was not loaded") from None
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        raise CheckpointError(f"{hf_dir}: cannot load a causal LM: {first_line(e)}") from None
    tokenizer = None
    if any((hf_dir / name).is_file() for name in _TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True, trust_remote_code=False)
        if len(tokenizer) > model.config.vocab_size:
            raise CheckpointError(
                f"{hf_dir}: the tokenizer has {len(tokenizer)} tokens but the model only {model.config.vocab_size}"
            )
    config = run_config_for(model.config, hf_dir, has_tokenizer=tokenizer is not None)

    def write(folder: Path) -> None:
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder)
        (folder / "config.yaml").write_text(dump_config(config))
        if tokenizer is not None:
            tokenizer.save_pretrained(folder / "tokenizer")
        # Last, as in training: the train state marks the folder complete.
        write_atomic(folder / TRAIN_STATE, TrainState(imported_from=str(hf_dir.resolve())).to_json())

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        publish_folder(out_dir, write)
    return out_dir


def run_config_for(hf_config: PretrainedConfig, hf_dir: Path, has_tokenizer: bool) -> RunConfig:
    """A RunConfig that rebuilds `hf_config`: model.arch is its model type, model.config its non-default fields."""
    arch = hf_config.model_type
    try:
        default_config = AutoConfig.for_model(arch)
    except ValueError:
        raise CheckpointError(f"{hf_dir}: model type {arch!r} is not one transformers knows") from None
    defaults = default_config.to_dict()
    # Keys the arch does not know (notes, legacy names already folded into new ones) cannot change the model.
    known = set(defaults) | set(dir(default_config))
    fields = {
        key: value
        for key, value in hf_config.to_dict().items()
        if key in known and not key.startswith("_") and key not in _FILE_FIELDS
        and (key in _PINNED_FIELDS or defaults.get(key) != value)
    }
    raw: dict[str, Any] = {"name": hf_dir.resolve().name, "model": {"arch": arch, "config": fields}, "data": {}}
    if has_tokenizer:
        raw["data"]["tokenizer"] = str(hf_dir.resolve())
    positions = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions < DataConfig.model_fields["seq_len"].default:
        raw["data"]["seq_len"] = positions  # the default would be longer than the model takes
    return validate(raw, checks=(model_config_problems,))


def _refuse_custom_code(*folders: Path) -> None:
    for folder in folders:
        if problem := custom_code(folder):
            raise CheckpointError(problem)


def refuse_non_empty(out_dir: Path) -> None:
    """Refuse an output directory that holds anything: an export or import never mixes with older files."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"{out_dir} already exists and is not empty; choose a new output directory")


def refuse_checkpoints_folder(out_dir: Path) -> None:
    """Refuse an export into a checkpoint or a run's checkpoints/ folder: it would be taken for a checkpoint, or
    removed as an interrupted one (its hidden `.tmp-step-N` sibling is the name of a save in flight)."""
    out = out_dir.resolve()
    if out.parent == RunDir(out.parent.parent).checkpoints and STEP_DIR.match(out.name):
        raise CheckpointError(f"{out_dir} is named like a checkpoint (checkpoints/step-N) and would be taken for "
                              "one; export to another directory, e.g. exports/<name>")
    for folder in out.parents:
        if (folder / TRAIN_STATE).is_file():
            raise CheckpointError(f"{out_dir} is inside the checkpoint {folder}; export to a directory of its own, "
                                  "e.g. exports/<name>")
        run = RunDir(folder.parent)
        if folder == run.checkpoints and (list_checkpoints(folder) or run.status.is_file()):
            raise CheckpointError(f"{out_dir} is inside the checkpoints folder of the run {folder.parent}, whose "
                                  "saves and clean-ups own it; export to a directory of its own, e.g. exports/<name>")


class ExportFailed(CheckpointError):
    """The disk filled (or the quota) while writing an export: exit 74, as for a failed checkpoint save."""

    exit_code = ExitCode.SAVE_FAILED


_NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}  # the user's choice of directory: exit 2
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def publish_folder(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Run `write` on a hidden sibling folder, then rename it to `out_dir`: a kill never leaves half a result, and
    a directory that cannot be written or a full disk is one line, the partial result removed."""
    out_dir = out_dir.resolve()  # "." has no name to put beside it
    tmp = out_dir.parent / f".tmp-{out_dir.name}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        _follow_umask(tmp)
        if out_dir.is_dir():
            out_dir.rmdir()  # empty, checked before
        os.replace(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and (error := _write_error(e, out_dir, tmp)):
            raise error from None
        raise


def _write_error(e: OSError, out_dir: Path, tmp: Path) -> CheckpointError | None:
    """The one line for a directory that cannot be written (exit 2) or a full disk (exit 74); None: another error."""
    failed = Path(e.filename) if e.filename else tmp
    where = tmp.parent if failed == tmp or tmp in failed.parents else failed  # not our hidden folder's name
    reason = (e.strerror or "").lower()
    if e.errno in _NOT_WRITABLE:
        return CheckpointError(f"cannot write {out_dir}: {reason} in {where}; choose a directory you can write to")
    if e.errno in _NO_SPACE:
        return ExportFailed(f"writing {out_dir} failed: {reason} in {where}; the partial copy was removed and "
                            "nothing else changed: free space and run it again")
    return None


def _follow_umask(folder: Path) -> None:
    """Give `folder` and everything in it the modes the user's umask asks for: writers that go through a
    private temporary file (safetensors) leave 0600, which the group cannot read on a shared cluster."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def check_can_push(repo: str) -> None:
    """Refuse `--push-to-hub` before any work where it cannot succeed: offline (HF_HUB_OFFLINE), or a bad repo id."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise CheckpointError(f"--push-to-hub {repo}: HF_HUB_OFFLINE is set, so nothing can be uploaded; export "
                              "without it and upload the folder where the network is reachable")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise CheckpointError(f"--push-to-hub {repo!r}: give a Hugging Face repo id, NAMESPACE/NAME")


def push_to_hub(folder: Path, repo: str) -> str:
    """Upload `folder` to the Hugging Face model repo `repo` (created private if it does not exist); its URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo, private=True, exist_ok=True)
        info = api.upload_folder(repo_id=repo, folder_path=folder, commit_message=f"clustertrain export {folder.name}")
    except Exception as e:  # network, auth, permissions: the export itself is done and stays
        raise CheckpointError(f"wrote {folder}, but uploading it to {repo} failed ({type(e).__name__}: "
                              f"{first_line(e)}); upload it again with `hf upload {repo} {folder}`") from None
    return info.commit_url
