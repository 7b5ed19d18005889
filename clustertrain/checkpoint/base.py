"""The frozen base a LoRA checkpoint refers to instead of holding it: its snapshot's path and a checksum.

A LoRA run's checkpoint holds only what trains (the adapters and their optimizer state); its train state
records `{"base": {"path": ..., "checksum": ...}}`. Resume, `export`, `generate` and `eval` load the base from
that snapshot, as a fresh start does, after checking that it is still the same one.

The checksum is cheap, so that no save hashes gigabytes: each weight file's name, size, and the sha256 of its
first and last MiB (safetensors start with their header: every tensor's name, dtype, shape and offsets),
plus `config.json`. A copy of the snapshot elsewhere has the same checksum; another model of the same shape
does not (its bytes differ in both ends of each file).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from clustertrain.errors import CheckpointError

_SAMPLED = 1 << 20  # bytes read from each end of a weight file
_WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json", "config.json")


def base_reference(snapshot: Path) -> dict[str, str]:
    """`{"path": absolute snapshot path, "checksum": ...}` of the snapshot a LoRA run trains on."""
    snapshot = Path(snapshot).resolve()
    return {"path": str(snapshot), "checksum": snapshot_checksum(snapshot)}


@functools.lru_cache(maxsize=4)
def snapshot_checksum(snapshot: Path) -> str:
    """A sha256 over the snapshot's weight files' names, sizes and first and last MiB, and config.json (cached:
    computed once per process)."""
    digest = hashlib.sha256()
    files = sorted({f for pattern in _WEIGHTS for f in snapshot.glob(pattern) if f.is_file()})
    if not files:
        raise CheckpointError(f"{snapshot}: no config.json or weight files, so it is not the base model a LoRA "
                              "checkpoint refers to")
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with file.open("rb") as f:
            digest.update(f.read(_SAMPLED))
            if size > 2 * _SAMPLED:
                f.seek(size - _SAMPLED)
                digest.update(f.read(_SAMPLED))
    return digest.hexdigest()[:32]


def check_base(saved: dict[str, Any], checkpoint: Path, snapshot: Path | None = None) -> Path:
    """The snapshot to load a LoRA checkpoint's base from: `snapshot` (this run's), else the one it recorded.

    Raises:
        CheckpointError: one line naming both snapshots when the base is missing or not the one trained on.
    """
    recorded = Path(saved["path"])
    where = Path(snapshot) if snapshot is not None else recorded
    if not where.is_dir():
        raise CheckpointError(f"{checkpoint} holds only LoRA adapters; their base model {where} does not exist "
                              "(restore the snapshot there, or point model.path at a copy of it)")
    found = snapshot_checksum(where.resolve())
    if found != saved["checksum"]:
        raise CheckpointError(
            f"{checkpoint} holds LoRA adapters trained on the base {recorded} (checksum {saved['checksum']}), but "
            f"{where} has checksum {found}: another model or changed files; use the snapshot it was trained on"
        )
    return where
