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
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from clustertrain.checkpoint.parts import model_parts, rank_state
from clustertrain.checkpoint.rng import rng_state
from clustertrain.checkpoint.train_state import TRAIN_STATE, TrainState
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
    state, _, _ = rank_state(model_parts(model, optimizer), StateDictOptions(ignore_frozen_params=trainable_only))
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

        class KeptStager(DefaultStager):
            """One stager for the run: its pinned buffers are what later saves reuse. Some torch versions close a
            stager after each save (async_save, or 2.11's synchronous stage, which closes its inner copier:
            the next save then failed with KeyError: <class 'type'>, seen on an H100); here nothing does."""

            def __init__(self, options: StagingOptions) -> None:
                super().__init__(options)
                inner = getattr(self, "_state_dict_stager", None)
                if inner is not None:
                    inner.close = lambda: None

            def close(self) -> None:
                pass

        return {"async_stager": KeptStager(options)}
    # async_save points the writer at each save's own folder (its checkpoint_id)
    return {"storage_writer": dcp.FileSystemWriter(".", cache_staged_state_dict=True)}


def commit(root: Path, step: int, train_state: TrainState, write_extras: Callable[[Path], None]) -> Path:
    """Make a fully written checkpoint visible: rank 0 adds the train state and renames it; all ranks call."""
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}"
    dist.barrier()  # every rank's shards are on disk
    if dist.get_rank() == 0:
        write_extras(tmp)
        after_write("config.yaml and tokenizer")
        write_atomic(tmp / TRAIN_STATE, train_state.to_json(), durable=True)  # last: a folder with one is complete
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
    keep |= {p for p in found if step_of(p) == final_step or (keep_every and step_of(p) % keep_every == 0)}
    removed = [p for p in found if p not in keep]
    for path in removed:
        discard(path)
    return removed


def discard(path: Path) -> None:
    """Delete a checkpoint folder so that it is never seen half-deleted: rename it out of sight, then delete."""
    hidden = path.with_name(f".trash-{path.name}-{os.getpid()}")
    os.replace(path, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


def step_of(path: Path) -> int:
    """The step of checkpoint folder `path` (named step-NNNNNNN)."""
    return int(STEP_DIR.match(path.name).group(1))


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
