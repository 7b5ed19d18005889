"""A run's config settled on a world once, before the run starts, and only read from then on.

    run = resolve(config, world_size=8, local_world_size=4, device_type="cuda")  # no process group needed
    run.config.train.global_batch_size, run.layout.degree("tp"), run.param_dtype  # every settled value
    run.choice.line                                     # parallel.strategy auto: the layout the planner chose
    clustertrain config show CONFIG --world 8           # the same, printed

Settled here, in a copy (configs are frozen: RunConfig.updated): the layout, fixed by the config or chosen by the
planner (`choose_or_check_layout`), with its global batch and pipeline microbatches written into the config so
that the run's config.yaml holds them, which a resume needs; the parameter dtype on the device; the model path
made absolute (adapters exported from the run load from anywhere); the tokenizer of a fine-tuned snapshot.
Only the step count of `train.epochs` needs the data: `clustertrain.resolve.epochs` adds it once it is counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from clustertrain.config.layout import Layout, apply_layout, resolve_layout
from clustertrain.config.schema import RunConfig
from clustertrain.hardware import param_dtype_for
from clustertrain.model.build import snapshot_dir
from clustertrain.model.spec import model_shape
from clustertrain.plan.auto import LayoutChoice, choose_layout
from clustertrain.resolve.packages import check_packages


@dataclass(frozen=True)
class Resolved:
    """A config settled on a world: what the trainer, `plan`, `config show|check` and `doctor` read."""

    config: RunConfig  # the layout's batch and microbatches, the dtype, the absolute model path written in
    layout: Layout
    snapshot: Path | None  # the local snapshot a fine-tuning run starts from
    choice: LayoutChoice | None  # parallel.strategy auto: the layout the planner chose, and why
    device_type: str | None  # "cuda" or "cpu"; None: not known here (a login node rendering a job)

    @property
    def param_dtype(self) -> str:
        """parallel.param_dtype as it runs on `device_type` ("auto" only where the device is not known)."""
        return self.config.parallel.param_dtype


def resolve(config: RunConfig, world_size: int, local_world_size: int, device_type: str | None) -> Resolved:
    """Check `config` on `world_size` ranks and settle everything derived; `config` itself is not changed.
    `device_type` ("cuda" or "cpu") settles parallel.param_dtype; None leaves it as configured.

    Raises:
        ConfigError: every problem of the config on this world, at once; or an optional package missing.
    """
    check_packages(config)
    settled, layout, choice = choose_or_check_layout(config, world_size, local_world_size, device_type)
    if device_type is not None:
        settled = settled.updated(parallel={"param_dtype": param_dtype_for(settled.parallel.param_dtype, device_type)})
    if config.model.path:
        settled = settled.updated(model={"path": str(Path(config.model.path).resolve())})
    snapshot = snapshot_dir(settled.model)
    if snapshot is not None and not config.data.tokenizer:
        settled = settled.updated(data={"tokenizer": str(snapshot)})  # fine-tuning: the model's own tokenizer
    return Resolved(settled, layout, snapshot, choice, device_type)


def choose_or_check_layout(config: RunConfig, world_size: int, local_world_size: int, device_type: str | None
                           ) -> tuple[RunConfig, Layout, LayoutChoice | None]:
    """The layout of `config` on the world and `config` laid out by it: under parallel.strategy auto the layout
    the planner chooses (it builds and steps a fake rank of each candidate), else the configured one, checked.

    Raises:
        ConfigError: every problem of the layout on this world, at once; or, under auto, no layout fits.
    """
    choice = None
    if config.parallel.strategy == "auto":
        choice = choose_layout(config, world_size, local_world_size, device_type)
        config = config.updated(**choice.overrides)
    layout = resolve_layout(config, world_size, local_world_size, model_shape(config.model, config.data.vocab_size))
    return apply_layout(config, layout), layout, choice
