"""Reading a checkpoint without trusting it: no code runs from its files, and damage or a model that does not
fit is one line that names the file or the tensor.

PyTorch's FileSystemReader unpickles `.metadata` with plain pickle, so a `__reduce__` written into it would
run on every rank before anything else looked at the file. Here `.metadata` goes through MetadataUnpickler,
which admits only the classes DCP metadata is made of; shards and non-tensor values (optimizer
hyperparameters) go through torch's weights-only unpickler. Every DCP load in clustertrain goes through
`load_state`, with `SafeReader` and `SafeLoadPlanner`:

    opened = open_checkpoint(path, rng_rank=0)              # train state, metadata, shards present: or one line
    check_fits(path, opened.metadata, state)                # every tensor's key and shape, before loading
    load_state(state, path, opened.metadata)
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (_MEM_FORMAT_ENCODING, BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.futures import Future

from clustertrain.checkpoint.train_state import TRAIN_STATE, TrainState
from clustertrain.distributed.collectives import all_gather_objects, all_reduce
from clustertrain.errors import CheckpointError, first_line
from clustertrain.model.weights import refusal

METADATA = ".metadata"
OTHER_SHAPES = "; it was saved by a model of other shapes (compare model.arch and model.config with its config.yaml)"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# Every global a DCP `.metadata` refers to. Found by unpickling real checkpoints (2-rank FSDP with DTensors,
# tensor parallel + LoRA in bfloat16, pipeline stages in float16, an imported HF model; all with optimizer
# state) with a find_class that records its calls. Dtypes (`torch.float32`, ...) are admitted by type below.
def _posix_path(*parts: str) -> pathlib.PurePath:
    return pathlib.PosixPath(*parts)


def _layout(name: str) -> torch.layout:
    return torch.serialization._get_layout(name)


# Every global a DCP `.metadata` refers to. Found by unpickling real checkpoints (2-rank FSDP with DTensors,
# tensor parallel + LoRA in bfloat16, pipeline stages in float16, an imported HF model; all with optimizer
# state) with a find_class that records its calls. Dtypes (`torch.float32`, ...) are admitted by type below.
# Functions and paths are only ever called, so they come as wrappers: a pickle cannot modify the real ones.
METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{(_DCP_METADATA, cls.__name__): cls for cls in (
        Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
        MetadataIndex, StorageMeta, _MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,  # a layout by name, e.g. "torch.strided"
    ("pathlib", "PosixPath"): _posix_path,  # StorageMeta.checkpoint_id: the folder the save was written to
    ("pathlib._local", "PosixPath"): _posix_path,  # the same, pickled by Python 3.13
}
_CLASSES = [cls for cls in METADATA_GLOBALS.values() if isinstance(cls, type) and cls is not torch.Size]


class UnsafeContent(pickle.UnpicklingError):
    """A pickle refers to something that is not part of checkpoint metadata."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, and refuses every global that DCP metadata does not use.

    A pickle can also set attributes on a class it names (BUILD on the class itself): `load` undoes that
    and refuses the file.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return METADATA_GLOBALS[module, name]
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return vars(torch)[name]
        raise UnsafeContent(f"it refers to {module}.{name}")

    def load(self) -> Any:
        before = {cls: dict(vars(cls)) for cls in _CLASSES}
        try:
            return super().load()
        finally:
            changed = [cls for cls in _CLASSES if vars(cls) != before[cls]]
            for cls in changed:
                for key in set(vars(cls)) - set(before[cls]):
                    delattr(cls, key)
                for key, value in before[cls].items():
                    if vars(cls).get(key) is not value:
                        setattr(cls, key, value)
            if changed:
                raise UnsafeContent(f"it changes the class {changed[0].__module__}.{changed[0].__name__}")


class DamagedCheckpoint(CheckpointError):
    """A checkpoint file is missing, truncated, unreadable or holds code: an earlier checkpoint may be intact."""


def unsafe(path: Path, reason: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(f"{path} holds code or non-tensor objects ({reason}) and was not loaded")


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of checkpoint folder `path`, unpickled with MetadataUnpickler.

    Raises:
        DamagedCheckpoint: the file is missing, truncated, not DCP metadata, or refers to anything else.
    """
    file = path / METADATA
    try:
        with file.open("rb") as f:
            metadata = MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{file} is missing, so the checkpoint's shards cannot be read") from None
    except UnsafeContent as e:
        raise unsafe(file, str(e)) from None
    except Exception as e:  # anything else a restricted unpickler meets in a damaged file
        raise DamagedCheckpoint(f"{file} is damaged ({type(e).__name__}: {first_line(e)})") from None
    if not (isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)
            and isinstance(metadata.storage_data, dict)
            and all(isinstance(v, _StorageInfo) for v in metadata.storage_data.values())):
        raise DamagedCheckpoint(f"{file} is damaged (not torch.distributed.checkpoint metadata)")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader that reads `.metadata` with MetadataUnpickler (or takes it already read) and names the
    shard file in every read error."""

    def __init__(self, path: Path, metadata: Metadata | None = None):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # clustertrain never writes rank-local metadata
            raise DamagedCheckpoint(f"{Path(self.path) / METADATA} is missing")
        metadata = self._metadata or read_metadata(Path(self.path))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner) -> Future[None]:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            file = Path(self.path) / name
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except pickle.UnpicklingError as e:  # torch's weights-only unpickler refused it
                raise unsafe(file, refusal(e)) from None
            except Exception as e:
                raise DamagedCheckpoint(f"{file} is damaged ({type(e).__name__}: {first_line(e)})") from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP unpickles non-tensor values (optimizer hyperparameters) freely; admit only plain data."""

    def load_bytes(self, read_item, value) -> None:
        torch.load(value, weights_only=True)  # raises on anything but tensors and plain Python data
        value.seek(0)
        super().load_bytes(read_item, value)


def load_state(state: dict[str, Any], path: Path, metadata: Metadata) -> None:
    """`dcp.load` of `state` (in place) from checkpoint `path`, with SafeReader and SafeLoadPlanner.

    Raises:
        DamagedCheckpoint: a shard is unreadable or holds code; every rank raises the same one.
    """
    try:
        dcp.load(state, storage_reader=SafeReader(path, metadata), planner=SafeLoadPlanner())
    except CheckpointException as e:  # DCP gathers every rank's failure; show the first clear one
        for rank in sorted(e.failures):
            exc = e.failures[rank][0]
            if isinstance(exc, CheckpointError):
                raise exc from None
        raise


@dataclasses.dataclass
class OpenedCheckpoint:
    train_state: TrainState
    metadata: Metadata
    rng: dict[str, Any] | None  # this rank's RNG state; None where the saving run had no such rank


def open_checkpoint(path: Path, rng_rank: int | None = None, shards: bool = True) -> OpenedCheckpoint:
    """Read and check what a load needs before it changes anything: the train state, the metadata, the
    shard files (`shards`) and the RNG state of `rng_rank`.

    Raises:
        DamagedCheckpoint: naming the first file that is missing, truncated or not what it should be.
    """
    file = path / TRAIN_STATE
    try:
        train_state = TrainState.from_dict(_read_json(file), file)
    except ValueError as e:
        raise DamagedCheckpoint(str(e)) from None
    metadata = read_metadata(path)
    if shards:
        _check_shards(path, metadata)
    rng = None
    if rng_rank is not None and rng_rank < (train_state.world_size or 0):
        rng = read_rng(path / f"rng-{rng_rank}.json")
    return OpenedCheckpoint(train_state, metadata, rng)


def _read_json(file: Path, what: str = "") -> Any:
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{file} is missing{what}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedCheckpoint(f"{file} is damaged (not JSON: {first_line(e)})") from None


def _check_shards(path: Path, metadata: Metadata) -> None:
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        if not isinstance(info.relative_path, str) or Path(info.relative_path).name != info.relative_path:
            raise DamagedCheckpoint(f"{path / METADATA} is damaged (names a shard outside its folder)")
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        try:
            found = (path / name).stat().st_size
        except FileNotFoundError:
            raise DamagedCheckpoint(f"{path / name} is missing") from None
        if found < size:
            raise DamagedCheckpoint(f"{path / name} is truncated ({found} bytes, {size} expected)")


def read_rng(file: Path) -> dict[str, Any]:
    state = _read_json(file, " (the RNG state of a rank of the saving run)")
    if not isinstance(state, dict) or not {"python", "numpy", "torch", "cuda"} <= set(state):
        raise DamagedCheckpoint(f"{file} is damaged (not an RNG state)")
    return state


def check_fits(path: Path, metadata: Metadata, state: dict[str, Any]) -> None:
    """Raise one line naming the first tensor of `state` that the checkpoint lacks or holds in another shape,
    or the first tensor the checkpoint holds that `state` lacks (among its top-level keys, e.g. model, optim).

    With a process group, every rank calls this with its own `state` (a pipeline stage holds only its
    layers): a checkpoint tensor is unexpected only if no rank holds it, and every rank raises the same line.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # DCP's own key naming

    flat, _ = flatten_state_dict(state)
    saved = metadata.state_dict_metadata
    problem = None
    for key, value in flat.items():
        if key not in saved and not isinstance(value, torch.Tensor):  # e.g. a hyperparameter of a newer torch
            problem = (f"the checkpoint has no {_name(key)}, which this run has; it was saved with another optimizer "
                       "or torch version")
        elif key not in saved:
            problem = f"the checkpoint has no {_name(key)} {_shape(value.shape)}, which this run has{OTHER_SHAPES}"
        elif isinstance(value, torch.Tensor) and isinstance(saved[key], TensorStorageMetadata) \
                and tuple(saved[key].size) != tuple(value.shape):  # a DTensor's shape is the global one
            problem = (f"{_name(key)} is {_shape(saved[key].size)} in the checkpoint but {_shape(value.shape)} "
                       f"in this run's model{OTHER_SHAPES}")
        if problem:
            break
    loaded = set(state)
    candidates = [k for k, v in saved.items() if isinstance(v, TensorStorageMetadata) and k.split(".", 1)[0] in loaded]
    held = [float(k in flat) for k in candidates]
    if dist.is_initialized() and dist.get_world_size() > 1 and candidates:
        held = all_reduce(held, op="max").tolist()
    unexpected = [k for k, h in zip(candidates, held) if not h]
    if problem is None and unexpected:
        problem = (f"the checkpoint holds {_name(unexpected[0])} {_shape(saved[unexpected[0]].size)}, which this "
                   f"run does not have{OTHER_SHAPES}")
    problem = agree(problem)
    if problem:
        raise CheckpointError(f"{path}: {problem}")


def agree(problem: str | None) -> str | None:
    """The problem of the lowest rank that has one (every rank gets the same), or None; a collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem
    return next((p for p in all_gather_objects(problem) if p), None)


def _name(key: str) -> str:
    """A flattened DCP key in the user's words: the parameter name, or what optimizer state it is."""
    top, _, rest = key.partition(".")
    if top == "optim" and rest.startswith("state."):
        return f"optimizer state {rest[len('state.'):]}"
    if top == "optim":
        return f"optimizer {rest}"
    return rest or key


def _shape(size) -> str:
    return f"({', '.join(str(n) for n in size)})" if len(size) != 1 else f"({size[0]},)"


