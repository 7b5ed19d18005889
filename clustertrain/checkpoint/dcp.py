"""Sharded checkpoints with torch.distributed.checkpoint, made visible only once complete.

Every rank writes its shards and RNG state into `checkpoints/.tmp-step-NNNNNNN/` (`write_shards`); once
all have finished, rank 0 adds the train state, the resolved config and the tokenizer and renames the
folder to `step-NNNNNNN/` (`commit`). A folder with the final name is therefore always complete; a
leftover `.tmp-*` is an interrupted save and is removed, or published if it was stopped after its last write.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.optim import Optimizer

from clustertrain.checkpoint.base import check_base
from clustertrain.checkpoint.reader import (TRAIN_STATE, DamagedCheckpoint, agree, check_fits, load_state,
                                            open_checkpoint, read_rng)
from clustertrain.distributed.collectives import rank_device
from clustertrain.errors import CheckpointError
from clustertrain.files import write_atomic

STEP_DIR = re.compile(r"^step-(\d{7,})$")


def _nothing_to_do(name: str) -> None:
    pass


# Called after each write of a save with the name of what was just written (then with the step folder's name once
# it is published): tests replace it to stop a save between two writes (tests/unit/checkpoint/test_commit_steps.py).
after_write: Callable[[str], None] = _nothing_to_do


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


def write_shards(root: Path, step: int, model: nn.Module | list[nn.Module], optimizer, async_group=None,
                 staging: dict[str, Any] | None = None, trainable_only: bool = False) -> Future | None:
    """Write every rank's model/optimizer shards and RNG state into `root/.tmp-step-N/`.

    `model` may be a rank's list of pipeline stages, with its Optimizers: their state dicts, keyed by
    full-model names, are saved as one. `trainable_only` (LoRA on a snapshot) leaves out the frozen parameters,
    which the train state's base reference (`clustertrain.checkpoint.base`) stands for. With `async_group` (a
    process group of its own, so background collectives never interleave with training's) the shards are
    staged into host memory, the writes go on in the background and a Future is returned; otherwise None, when
    done. `staging` (from `pinned_staging()`, the same for every save) stages a GPU rank's shards into pinned
    host memory kept from one save to the next.
    """
    tmp = root / f".tmp-{step_dir_name(step)}"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    _write_json(tmp / f"rng-{dist.get_rank()}.json", rng_state())
    after_write(f"rng-{dist.get_rank()}.json")
    parts = _parts(model, optimizer)
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    states = [get_state_dict(module, optim, options=options) for module, optim in parts]
    state = {"model": {k: v for model_state, _ in states for k, v in model_state.items()},
             "optim": _merge_optim([_rename_optim_state(optim_state, _tied_copies(module))
                                    for (module, _), (_, optim_state) in zip(parts, states)])}
    if async_group is None:
        dcp.save(state, checkpoint_id=tmp)
        after_write("shards and .metadata")
        return None
    return dcp.async_save(state, checkpoint_id=tmp, process_group=async_group, **(staging or {}))


def pinned_staging() -> dict[str, Any]:
    """`dcp.async_save` arguments that stage a GPU rank's shards through pinned host memory, allocated at the
    first save and reused by every later one (pass the same ones each time, and stage again only once the
    previous save is written: it reads those buffers).

    torch's DefaultStager where this torch has it (2.9 and later): non-blocking device-to-host copies, then
    one sync. Else (torch 2.8) a FileSystemWriter that caches its staged state dict, copying tensor by tensor.
    """
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        DefaultStager = None
    wanted = {"use_pinned_memory", "use_shared_memory", "use_async_staging", "use_non_blocking_copy"}
    if (DefaultStager is not None and "async_stager" in inspect.signature(dcp.async_save).parameters
            and wanted <= {f.name for f in dataclasses.fields(StagingOptions)}):
        # synchronous staging: the copies are done when async_save returns, so the optimizer may step again
        options = StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=False,
                                 use_non_blocking_copy=True)
        return {"async_stager": DefaultStager(options)}
    # async_save points the writer at each save's own folder (its checkpoint_id)
    return {"storage_writer": dcp.FileSystemWriter(".", cache_staged_state_dict=True)}


def commit(root: Path, step: int, train_state: dict[str, Any], write_extras: Callable[[Path], None]) -> Path:
    """Make a fully written checkpoint visible: rank 0 adds the train state and renames it; all ranks call."""
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}"
    dist.barrier()  # every rank's shards are on disk
    if dist.get_rank() == 0:
        write_extras(tmp)
        after_write("config.yaml and tokenizer")
        _write_json(tmp / TRAIN_STATE, train_state)  # last: a folder with a train state is complete
        after_write(TRAIN_STATE)
        old = final.with_name(f".trash-{final.name}-{os.getpid()}")
        if final.exists():  # saved before (a resume from an earlier checkpoint): kept until the new one is published
            os.replace(final, old)
            after_write(old.name)
        os.replace(tmp, final)
        _fsync_dir(root)  # the rename itself survives a node crash
        after_write(final.name)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def prune(root: Path, keep_last: int | None, keep_every: int | None, final_step: int) -> list[Path]:
    """Delete complete checkpoints outside the last `keep_last`, the multiples of `keep_every` and the final one."""
    found = list_checkpoints(root)
    keep = set(found[-keep_last:] if keep_last else found)
    keep |= {p for p in found if _step(p) == final_step or (keep_every and _step(p) % keep_every == 0)}
    removed = [p for p in found if p not in keep]
    for path in removed:
        discard(path)
    return removed


def discard(path: Path) -> None:
    """Delete a checkpoint folder so that it is never seen half-deleted: rename it out of sight, then delete."""
    hidden = path.with_name(f".trash-{path.name}-{os.getpid()}")
    os.replace(path, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


class CudaRng:
    """The CUDA calls of rng_state() and set_rng_state(): one device's generator. A CPU test stands in its own."""

    def get(self, device: torch.device) -> torch.Tensor:
        return torch.cuda.get_rng_state(device)

    def set(self, state: torch.Tensor, device: torch.device) -> None:
        torch.cuda.set_rng_state(state, device)


cuda_rng = CudaRng()


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states of this rank, as JSON: the CUDA one of its own device only."""
    np_state = np.random.get_state()
    device = rank_device()
    return {
        "python": _to_lists(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
        "cuda": [cuda_rng.get(device).tolist()] if device.type == "cuda" else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what rng_state() saved, into this rank's own device.

    The resuming rank may see fewer GPUs than the saving one (srun --gpus-per-task=1 after torchrun, a smaller
    node). Checkpoints from before one entry per rank hold every GPU the rank saw: the entry of this rank's
    device index is taken where there is one, else the first.
    """
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    saved, device = state["cuda"], rank_device()
    if saved and device.type == "cuda":
        index = device.index or 0
        own = saved[index] if index < len(saved) else saved[0]
        cuda_rng.set(torch.tensor(own, dtype=torch.uint8), device)


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, (tuple, list)) else value


def _step(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def load_checkpoint(path: Path, model: nn.Module | list[nn.Module], optimizer,
                    snapshot: Path | None = None) -> dict[str, Any]:
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
    base = opened.train_state.get("base")
    if base is not None:
        if snapshot is None:
            raise CheckpointError(f"{path} holds only LoRA adapters over the base {base['path']}; set model.path "
                                  "to that snapshot to resume it")
        problem = None
        try:  # every rank reads the snapshot: agree on one line
            check_base(base, path, snapshot)
        except CheckpointError as e:
            problem = str(e)
        problem = agree(problem)
        if problem:
            raise CheckpointError(problem)
    options = StateDictOptions(ignore_frozen_params=base is not None, strict=base is None)
    has_optim = any(k.startswith("optim.") for k in opened.metadata.state_dict_metadata)
    parts = _parts(model, optimizer)
    if optimizer is None or not has_optim:  # an imported HF model: weights only, fresh optimizer
        model_states = [get_state_dict(module, [], options=options)[0] for module, _ in parts]
        state = {"model": {k: v for model_state in model_states for k, v in model_state.items()}}
    else:
        states = [get_state_dict(module, optim, options=options) for module, optim in parts]
        renamed = [_rename_optim_state(optim_state, _tied_copies(module))
                   for (module, _), (_, optim_state) in zip(parts, states)]
        state = {"model": {k: v for model_state, _ in states for k, v in model_state.items()},
                 "optim": _merge_optim(renamed)}
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
        copies = _tied_copies(module)
        optim_state = _rename_optim_state(optim_state, {v: k for k, v in copies.items()})
        set_state_dict(module, optim, model_state_dict=model_state, optim_state_dict=optim_state, options=options)
    return opened.train_state


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
    older = [p for p in list_checkpoints(path.parent) if _step(p) < _step(path)]
    for candidate in reversed(older):
        try:
            opened = open_checkpoint(candidate)
            for rank in range(opened.train_state.get("world_size", 0)):
                read_rng(candidate / f"rng-{rank}.json")
        except DamagedCheckpoint:
            continue
        return candidate
    return None


def _parts(model: nn.Module | list[nn.Module], optimizer) -> list[tuple[nn.Module, Optimizer | None]]:
    """(module, its optimizer) pairs: one for a whole model, one per stage for a rank's pipeline stages."""
    modules = model if isinstance(model, list) else [model]
    optimizers = getattr(optimizer, "optimizers", None) or [optimizer] * len(modules)
    assert len(optimizers) == len(modules), "one optimizer per pipeline stage"
    return list(zip(modules, optimizers))


def _merge_optim(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Stage optimizers' states as one optimizer's: the union of states, group j's parameters joined, so a
    checkpoint holds as many param groups under any pipeline layout (DCP stores each group by index)."""
    groups: list[dict[str, Any]] = []
    for optim_state in states:
        for j, group in enumerate(optim_state["param_groups"]):
            if j < len(groups):
                groups[j] = {**groups[j], "params": [*groups[j]["params"], *group["params"]]}
            else:
                groups.append(dict(group))
    return {"state": {k: v for optim_state in states for k, v in optim_state["state"].items()},
            "param_groups": groups}


def _tied_copies(model: nn.Module) -> dict[str, str]:
    """The last pipeline stage's copies of tied weights (head name -> embedding name), else nothing.

    The full model's optimizer keeps a tied weight's state under the embedding's name only, so the last
    stage saves and loads its head's state under that name too: the first stage holds the same values
    (both copies take the same summed gradients), and checkpoints then move between layouts by name.
    """
    if getattr(model, "is_last", False) and not model.is_first:
        return dict(model.tied_names)
    return {}


def _rename_optim_state(optim_state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """`optim_state` (get_state_dict's form: state and param_groups keyed by parameter name) with names replaced."""
    if not names:
        return optim_state
    return {
        "state": {names.get(k, k): v for k, v in optim_state["state"].items()},
        "param_groups": [{**g, "params": [names.get(n, n) for n in g["params"]]} for g in optim_state["param_groups"]],
    }


def move_aside(run_dir: Path) -> Path:
    """Move a run's checkpoints and logs into `run_dir/replaced-<time>/`: starting over loses nothing."""
    target = run_dir / time.strftime("replaced-%Y%m%d-%H%M%S")
    target.mkdir(parents=True)
    for name in ("checkpoints", "metrics.jsonl", "samples.jsonl", "tensorboard", "config.yaml"):
        if (run_dir / name).exists():
            os.replace(run_dir / name, target / name)
    return target


def remove_incomplete(root: Path) -> None:
    """Delete the leftovers of interrupted saves and deletions (rank 0 only). A save stopped after its last write
    (its train state) but before its rename is complete: it is published, unless its step is there already."""
    if not root.is_dir():
        return
    for tmp in root.glob(".tmp-step-*"):
        final = tmp.with_name(tmp.name.removeprefix(".tmp-"))
        if (tmp / TRAIN_STATE).is_file() and not final.exists():
            os.replace(tmp, final)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    for trash in root.glob(".trash-step-*"):
        shutil.rmtree(trash, ignore_errors=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(data, indent=1), durable=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
