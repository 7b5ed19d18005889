"""Loading a checkpoint into a run's model and optimizer, whatever the layout that saved it: every file and
shape checked first (clustertrain.checkpoint.reader), then one DCP load, then each rank's RNG state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from clustertrain.checkpoint.base import check_base
from clustertrain.checkpoint.dcp import STEP_DIR, list_checkpoints, step_of
from clustertrain.checkpoint.parts import model_parts, rank_state, rename_optim_state, tied_copies
from clustertrain.checkpoint.reader import (DamagedCheckpoint, agree, check_fits, load_state, open_checkpoint,
                                            read_rng)
from clustertrain.checkpoint.rng import set_rng_state
from clustertrain.checkpoint.train_state import TRAIN_STATE, TrainState
from clustertrain.errors import CheckpointError


def load_checkpoint(path: Path, model: nn.Module | list[nn.Module], optimizer,
                    snapshot: Path | None = None) -> TrainState:
    """Load a checkpoint into this run's (possibly differently sharded) model and optimizer.

    `model` may be a rank's list of pipeline stages, with its Optimizers (see write_shards). Every rank
    calls this. Nothing is loaded before every file the load needs and every tensor's shape have been checked.
    A LoRA checkpoint that holds only what trains (its train state has a `base`) is loaded over the frozen base
    already in `model`, which must come from `snapshot`, the base it was trained on.

    Raises:
        CheckpointError: one line, the same on every rank: a damaged file (ending with `--resume PATH` of the
            previous intact checkpoint where there is one), or a model whose shapes differ from the checkpoint's.
    """
    if not (path / TRAIN_STATE).exists():
        raise CheckpointError(f"{path} is not a complete clustertrain checkpoint (no {TRAIN_STATE})")
    rank = dist.get_rank() if dist.is_initialized() else 0
    problem = None
    try:  # rank 0 checks the shard files; each rank its own RNG state
        opened = open_checkpoint(path, rng_rank=rank, shards=rank == 0)
        if opened.rng is not None:  # a rank that did not exist in the saving run keeps its seeded state
            _restore_rng(path / f"rng-{rank}.json", opened.rng)  # nothing below draws random numbers
    except DamagedCheckpoint as e:
        problem = str(e)
    problem = agree(problem)
    if problem:
        raise with_hint(problem, path, resume=True)
    base = opened.train_state.base
    if base is not None:
        _check_base(base, path, snapshot)
    options = StateDictOptions(ignore_frozen_params=base is not None, strict=base is None)
    has_optim = any(k.startswith("optim.") for k in opened.metadata.state_dict_metadata)
    parts = model_parts(model, optimizer)
    if optimizer is None or not has_optim:  # an imported HF model: weights only, fresh optimizer
        model_states = [get_state_dict(module, [], options=options)[0] for module, _ in parts]
        state = {"model": {k: v for model_state in model_states for k, v in model_state.items()}}
    else:
        state, states, renamed = rank_state(parts, options)
    check_fits(path, opened.metadata, state)
    try:
        load_state(state, path, opened.metadata)  # in place: shared tensors
    except DamagedCheckpoint as e:
        raise with_hint(str(e), path, resume=True) from None
    if "optim" not in state:
        for (module, _), model_state in zip(parts, model_states):
            set_state_dict(module, [], model_state_dict=model_state, optim_state_dict={}, options=options)
        return opened.train_state
    loaded = state["optim"]
    for (module, optim), (model_state, _), own in zip(parts, states, renamed):
        # each optimizer keeps its own parameters, with the saved hyperparameters of their group
        groups = [{**(loaded["param_groups"][j] if j < len(loaded["param_groups"]) else {}),
                   "params": group["params"]} for j, group in enumerate(own["param_groups"])]
        optim_state = {"state": {k: loaded["state"][k] for k in own["state"]}, "param_groups": groups}
        copies = tied_copies(module)
        optim_state = rename_optim_state(optim_state, {v: k for k, v in copies.items()})
        set_state_dict(module, optim, model_state_dict=model_state, optim_state_dict=optim_state, options=options)
    return opened.train_state


def _check_base(base: dict[str, Any], path: Path, snapshot: Path | None) -> None:
    """A LoRA checkpoint's frozen base must be `snapshot`; every rank reads it and all raise the same line."""
    if snapshot is None:
        raise CheckpointError(f"{path} holds only LoRA adapters over the base {base['path']}; set model.path "
                              "to that snapshot to resume it")
    problem = None
    try:
        check_base(base, path, snapshot)
    except CheckpointError as e:
        problem = str(e)
    problem = agree(problem)
    if problem:
        raise CheckpointError(problem)


def _restore_rng(file: Path, state: dict[str, Any]) -> None:
    try:
        set_rng_state(state)
    except (TypeError, ValueError, RuntimeError, KeyError, IndexError) as e:
        raise DamagedCheckpoint(f"{file} is damaged (not an RNG state: {type(e).__name__})") from None


def with_hint(problem: str, path: Path, resume: bool) -> CheckpointError:
    """`problem` of damaged checkpoint `path` as an error that names the previous intact checkpoint, if any:
    as `--resume PATH` for training (`resume`), else as a path. Never a silent fallback."""
    previous = previous_intact(path)
    if previous is None:
        return CheckpointError(problem)
    if resume:
        return CheckpointError(f"{problem}; to go on from the previous intact checkpoint: --resume {previous}")
    return CheckpointError(f"{problem}; the previous intact checkpoint is {previous}")


def previous_intact(path: Path) -> Path | None:
    """The newest complete checkpoint beside `path` and older than it whose files all check out, or None."""
    if not STEP_DIR.match(path.name):
        return None
    older = [p for p in list_checkpoints(path.parent) if step_of(p) < step_of(path)]
    for candidate in reversed(older):
        try:
            opened = open_checkpoint(candidate)
            for rank in range(opened.train_state.world_size or 0):
                read_rng(candidate / f"rng-{rank}.json")
        except DamagedCheckpoint:
            continue
        return candidate
    return None
