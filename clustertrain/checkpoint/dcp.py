"""Sharded checkpoints with torch.distributed.checkpoint, made visible only once complete.

Every rank writes its shards into `checkpoints/.tmp-step-NNNNNNN/`; after a barrier rank 0 adds the
train state and the resolved config, then renames the folder to `step-NNNNNNN/`. A folder with the
final name is therefore always complete; a leftover `.tmp-*` is an interrupted save and is removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from clustertrain.errors import CheckpointError

STEP_DIR = re.compile(r"^step-(\d{7,})$")
TRAIN_STATE = "train_state.json"


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / TRAIN_STATE).exists()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: Optimizer,
    train_state: dict[str, Any],
    write_extras: Callable[[Path], None],
) -> Path:
    """Save model and optimizer shards plus the train state; every rank must call this.

    `write_extras(folder)` runs on rank 0 before the folder becomes visible (config, tokenizer).
    """
    rank0 = dist.get_rank() == 0
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}"
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
    if rank0:
        write_extras(tmp)
        _write_json(tmp / TRAIN_STATE, train_state)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    dist.barrier()
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
    """Load a checkpoint into this run's (possibly differently sharded) model and optimizer."""
    if not (path / TRAIN_STATE).exists():
        raise CheckpointError(f"{path} is not a complete clustertrain checkpoint (no {TRAIN_STATE})")
    model_state, optim_state = get_state_dict(model, optimizer) if optimizer else (get_state_dict(model, [])[0], None)
    state = {"model": model_state}
    if optimizer is not None:
        state["optim"] = optim_state
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer or [], model_state_dict=state["model"], optim_state_dict=state.get("optim", {}))
    return json.loads((path / TRAIN_STATE).read_text())


def remove_incomplete(root: Path) -> None:
    """Delete the leftovers of interrupted saves (rank 0 only)."""
    if root.is_dir():
        for p in root.glob(".tmp-step-*"):
            shutil.rmtree(p, ignore_errors=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
