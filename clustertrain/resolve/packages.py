"""The optional packages a config needs, checked before anything runs: a missing one is one line naming the
extra to install (the schema itself never looks at what is installed)."""

from __future__ import annotations

import importlib.util

from clustertrain.config.metrics_schema import MetricsConfig
from clustertrain.config.schema import RunConfig
from clustertrain.errors import ConfigError


def eval_package_problems(config: RunConfig) -> list[str]:
    """train.eval_tasks needs lm-evaluation-harness: one line if it is not installed, else []."""
    if config.train.eval_tasks and importlib.util.find_spec("lm_eval") is None:
        return ["config error: train.eval_tasks needs lm-evaluation-harness: pip install 'clustertrain[eval]'"]
    return []


def check_trackers(metrics: MetricsConfig) -> None:
    """Raises ConfigError (one line naming the extra to install) if an enabled tracker's package is missing."""
    for section, module in ((metrics.wandb, "wandb"), (metrics.mlflow, "mlflow")):
        if section.enabled and importlib.util.find_spec(module) is None:
            raise ConfigError(f"metrics.{module}.enabled needs {module}, which is not installed: "
                              f"pip install 'clustertrain[{module}]'")


def check_packages(config: RunConfig) -> None:
    """Every optional package `config` needs is installed (train.eval_tasks', the enabled trackers').

    Raises:
        ConfigError: one line for the first one missing, naming the extra to install.
    """
    problems = eval_package_problems(config)
    if problems:
        raise ConfigError(problems[0])
    check_trackers(config.metrics)
