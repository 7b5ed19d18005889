"""The step budget of a run: its optimizer steps, and whether a resumed run's budget reaches past its checkpoint.

    total = total_steps(config)                                  # from train.tokens, else train.steps
    check_budget_reaches(config.train, total, state.step, path)  # or one ConfigError naming the key to raise
"""

from __future__ import annotations

import math

from clustertrain.config.schema import RunConfig, TrainConfig
from clustertrain.errors import ConfigError


def total_steps(config: RunConfig) -> int:
    """Optimizer steps of the whole run, from `train.tokens` when set, else `train.steps` (which train.epochs
    sets at start, once the data is counted). The global batch must be resolved (config.layout.apply_layout)."""
    train = config.train
    if train.tokens:
        return math.ceil(train.tokens / config.tokens_per_step)
    if train.steps is None:
        raise ConfigError("train: set train.steps, train.tokens or train.epochs")
    return train.steps


def check_budget_reaches(train: TrainConfig, total: int, step: int, checkpoint: object) -> None:
    """A resumed run's budget (`total` steps) must reach past its checkpoint's `step`: below it, the run would
    "train" from step 4 of 2 and report success."""
    if step <= total:
        return
    key = next(k for k in ("tokens", "epochs", "steps") if getattr(train, k) is not None)
    budget = f"train.{key} = {getattr(train, key)}" + (f" ({total} steps)" if key != "steps" else "")
    raise ConfigError(f"{budget} is below the checkpoint's step {step} ({checkpoint}); set train.{key} to train past "
                      f"step {step}, or start over with --resume none --overwrite")
