"""A config file and its overrides read into a RunConfig with every check that needs no world: the schema's, the
model's (against transformers: the model's config.json at most, never weights) and the optional packages'.

    config = load_checked_config("configs/tiny-llama.yaml", ["parallel.tp=2"])   # or one ConfigError, every problem

config/ cannot import model/, so `clustertrain.config.load.load_config` checks the schema alone; every command
that reads a config reads it with `load_checked_config`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from clustertrain.config.load import load_config
from clustertrain.config.schema import RunConfig
from clustertrain.model.spec import model_config_problems
from clustertrain.resolve.packages import eval_package_problems


def load_checked_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """`clustertrain.config.load.load_config` with the model's checks (model.config against the HF config class
    of model.arch or of a local snapshot, the model it describes buildable, LoRA's targets its modules) and
    train.eval_tasks' package.

    Raises:
        ConfigError: one line per problem, the schema's, the model's, the packages' and any secrets' together.
    """
    return load_config(path, overrides, checks=(model_config_problems, eval_package_problems))
