"""Convert between training checkpoints (DCP folders) and Hugging Face model directories, on one CPU process.

    clustertrain export runs/tiny-llama/checkpoints/step-0000300 exports/tiny-llama
    clustertrain import exports/tiny-llama runs/imported/checkpoints/step-0000000

Both directions hold the whole model in fp32 CPU memory once; neither needs a process group, and
optimizer state is never read (export) or written (import).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from clustertrain.checkpoint.dcp import latest_checkpoint, with_hint
from clustertrain.checkpoint.reader import (TRAIN_STATE, DamagedCheckpoint, check_fits, first_line, load_state,
                                            open_checkpoint)
from clustertrain.config.load import dump_config, load_config, validate
from clustertrain.config.schema import DataConfig, RunConfig
from clustertrain.errors import CheckpointError
from clustertrain.model.load import build_hf_config, build_meta_model
from clustertrain.model.weights import init_weights, refusal

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
    newest = latest_checkpoint(path / "checkpoints")
    if newest is not None:
        return newest
    raise CheckpointError(f"{path} is not a complete clustertrain checkpoint (no {TRAIN_STATE}) nor a run with one")


def load_checkpoint_model(ckpt_dir: str | Path) -> tuple[PreTrainedModel, Any, RunConfig]:
    """Build the checkpoint's model on CPU in fp32 and load its weights, without a process group.

    Args:
        ckpt_dir: a `step-NNNNNNN/` folder, or a run directory (its newest complete checkpoint).

    Returns:
        (model in eval mode, tokenizer or None, the run's resolved config).
    """
    path = resolve_checkpoint(ckpt_dir)
    try:
        opened = open_checkpoint(path)
    except DamagedCheckpoint as e:
        raise with_hint(str(e), path, resume=False) from None
    if not (path / "config.yaml").is_file():
        raise CheckpointError(f"{path}: no config.yaml, so the model cannot be rebuilt")
    config = load_config(path / "config.yaml")
    tokenizer = None
    if (path / "tokenizer").is_dir():
        tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer", local_files_only=True)
    if config.model.pretrained:  # the snapshot's HF config, saved with the checkpoint: no snapshot needed
        hf_config = AutoConfig.from_pretrained(path / "model", local_files_only=True)
    else:  # An imported model pins its vocab_size, which may be below data.vocab_size's floor.
        vocab_size = config.model.config.get("vocab_size", config.data.vocab_size)
        hf_config = build_hf_config(config.model, tokenizer, vocab_size)
    model = build_meta_model(hf_config, config.lora)
    init_weights(model, torch.device("cpu"), seed=0)  # also fills non-persistent buffers (rotary tables)
    state = {"model": get_model_state_dict(model)}
    check_fits(path, opened.metadata, state)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        try:
            load_state(state, path, opened.metadata)
        except DamagedCheckpoint as e:
            raise with_hint(str(e), path, resume=False) from None
    set_model_state_dict(model, state["model"])
    return model.eval(), tokenizer, config


def export_hf(ckpt_dir: str | Path, out_dir: str | Path, max_shard_size: str | int = "2GB",
              merge: bool = False) -> Path:
    """Write a checkpoint as a Hugging Face directory, with its tokenizer.

    A full model gives config, safetensors and generation config. A LoRA run gives its adapter in peft's
    format (`adapter_config.json`, `adapter_model.safetensors`), or with `merge` the full model with the
    adapter merged into the base weights.

    Returns:
        `out_dir`, loadable with `AutoModelForCausalLM.from_pretrained(out_dir)` (full or merged) or
        `peft.PeftModel.from_pretrained(base_model, out_dir)` (adapter).
    """
    from clustertrain.lora import is_lora

    out_dir = Path(out_dir)
    _refuse_non_empty(out_dir)
    model, tokenizer, config = load_checkpoint_model(ckpt_dir)
    adapter = is_lora(model) and not merge
    if adapter:  # peft records where the base model is, for PeftModel / AutoPeftModel loading
        model.peft_config["default"].base_model_name_or_path = config.model.path or config.model.hub_id
    elif is_lora(model):
        model = model.merge_and_unload()

    def write(folder: Path) -> None:
        if adapter:
            model.save_pretrained(folder, safe_serialization=True)
        else:
            model.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
            if not (folder / "generation_config.json").exists():
                model.generation_config.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    _publish(out_dir, write)
    return out_dir


def import_hf(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a local Hugging Face model directory as a clustertrain checkpoint folder (weights only, step 0).

    Returns:
        `out_dir`, a weights-only checkpoint for `load_checkpoint_model`, or a start for `train.resume`.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    _refuse_non_empty(out_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32)
    except pickle.UnpicklingError as e:  # transformers reads .bin files weights-only
        files = ", ".join(str(f) for f in sorted(hf_dir.glob("*.bin"))) or str(hf_dir)
        raise CheckpointError(f"{files} holds code or non-tensor objects ({refusal(e)}) and was not loaded") from None
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        raise CheckpointError(f"{hf_dir}: cannot load a causal LM: {first_line(e)}") from None
    tokenizer = None
    if any((hf_dir / name).is_file() for name in _TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
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
        state = {"step": 0, "tokens_seen": 0, "imported_from": str(hf_dir.resolve())}
        (folder / TRAIN_STATE).write_text(json.dumps(state, indent=1))

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        _publish(out_dir, write)
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
    return validate(raw)


def _refuse_non_empty(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"{out_dir} already exists and is not empty; choose a new output directory")


def _publish(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Run `write` on a hidden sibling folder, then rename it to `out_dir`: a kill never leaves half a result."""
    out_dir = out_dir.resolve()  # "." has no name to put beside it
    tmp = out_dir.parent / f".tmp-{out_dir.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _follow_umask(tmp)
    if out_dir.is_dir():
        out_dir.rmdir()  # empty, checked before
    os.replace(tmp, out_dir)


def _follow_umask(folder: Path) -> None:
    """Give `folder` and everything in it the modes the user's umask asks for: writers that go through a
    private temporary file (safetensors) leave 0600, which the group cannot read on a shared cluster."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
