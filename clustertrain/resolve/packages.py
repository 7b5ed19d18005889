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


def check_pipeline_transformers(config: RunConfig, version: str | None = None) -> None:
    """parallel.pp > 1 runs the families' stage forwards, written for (and tested under) transformers 5: under 4.x
    their decoder layers return tuples and their masks take other arguments. One line, not a crash mid-run."""
    if config.parallel.pp > 1:
        import transformers

        version = version or transformers.__version__
        if int(version.split(".", 1)[0]) < 5:
            raise ConfigError(f"parallel.pp = {config.parallel.pp} needs transformers 5 or newer (installed: "
                              f"{version}); use parallel.pp: 1 under transformers 4, or pip install "
                              "'transformers>=5'")


def check_packages(config: RunConfig) -> None:
    """Every optional package `config` needs is installed (train.eval_tasks', the enabled trackers'), and the
    installed transformers runs its pipeline stages.

    Raises:
        ConfigError: one line for the first one missing, naming the extra to install.
    """
    problems = eval_package_problems(config)
    if problems:
        raise ConfigError(problems[0])
    check_trackers(config.metrics)
    check_pipeline_transformers(config)
