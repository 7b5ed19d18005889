"""The train state: what a checkpoint holds besides weights and optimizer state, written and read here only.

`train_state.json` is the last file a save writes (clustertrain.checkpoint.dcp.commit): a step folder that
has one is complete.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRAIN_STATE = "train_state.json"
COUNTS = ("step", "tokens_seen", "world_size")  # checked on every read: a damaged file is named, not trusted


@dataclass
class TrainState:
    """Where a run stands at a checkpoint.

    Attributes:
        step, tokens_seen: optimizer steps and tokens trained on so far.
        total_steps: the budget of the run that saved it (`clustertrain slurm` compares it with the step).
        data: the loader's global position (clustertrain.data.loader.StreamLoader.state_dict); None for an
            imported model, whose run starts the data from the beginning.
        world_size: ranks of the saving run (one RNG file each); None for an imported model.
        strategy: parallel.strategy of the saving run.
        grad_scaler: the float16 loss scaler's state, when the run had one.
        base: the snapshot a LoRA checkpoint's frozen weights come from (clustertrain.checkpoint.base); the
            checkpoint then holds only what trains.
        imported_from: the HF folder `clustertrain export --import` read.
    """

    step: int = 0
    tokens_seen: int = 0
    total_steps: int | None = None
    data: dict[str, Any] | None = None
    world_size: int | None = None
    strategy: str | None = None
    grad_scaler: dict[str, Any] | None = None
    base: dict[str, Any] | None = None
    imported_from: str | None = None

    def to_json(self) -> str:
        """The file's text: the fields that are set."""
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if v is not None}, indent=1)

    @classmethod
    def from_dict(cls, data: Any, file: Path) -> TrainState:
        """The train state read from `file` (keys of other versions are ignored).

        Raises:
            ValueError: one line naming the file and the first field that is not what it should be.
        """
        if not isinstance(data, dict):
            raise ValueError(f"{file}: step is None, not a count")
        for key in COUNTS:
            value = data.get(key, 0 if key == "world_size" else None)
            if type(value) is not int or value < 0:  # an imported model's checkpoint has no world_size
                raise ValueError(f"{file}: {key} is {value!r}, not a count")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
