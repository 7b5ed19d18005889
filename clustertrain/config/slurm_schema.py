"""The `slurm` section, and time limits as Slurm reads them (slurm.time, train.walltime)."""

from __future__ import annotations

import datetime
import math
import re
import unicodedata
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from clustertrain.config.secrets import SECRET_NAME
from clustertrain.config.section import ConfigPath, Section

SLURM_TIME_FORMS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"  # sbatch --time
# Time limits, kept as written and read by one parser (parse_slurm_time): slurm.time (a number is minutes, as in
# sbatch) and train.walltime (a number is seconds).
SlurmTime = Annotated[str, BeforeValidator(lambda v: slurm_time_text(v, minutes=True)),
                      AfterValidator(lambda v: _parses(v, parse_slurm_time))]
Walltime = Annotated[str | float | None, BeforeValidator(lambda v: slurm_time_text(v, minutes=False)),
                     AfterValidator(lambda v: _parses(v, walltime_seconds))]


def parse_slurm_time(value: str) -> float:
    """Seconds in a Slurm time limit, by sbatch --time's rule: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.

    A bare number is minutes, and the leading field takes any size ("90" is 90 minutes, "36:00:00" a day and a
    half), as Slurm's own parser does. UNLIMITED or INFINITE (any case), and a limit of zero, mean no limit:
    math.inf. Anything else raises a one-line ValueError.
    """
    text = str(value)
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return math.inf
    if m := re.fullmatch(r"([0-9]+)-([0-9]+)(?::([0-9]+))?(?::([0-9]+))?", text):
        days, hours, minutes, seconds = (int(x or 0) for x in m.groups())
    elif m := re.fullmatch(r"([0-9]+)(?::([0-9]+))?(?::([0-9]+))?", text):
        first, second, third = (int(x) if x else None for x in m.groups())
        days, hours, minutes, seconds = (0, first, second, third) if third is not None else (0, 0, first, second or 0)
    else:
        raise ValueError(f"not a Slurm time: use {SLURM_TIME_FORMS} (e.g. 90, 02:00:00, 1-12), or UNLIMITED")
    total = days * 86400 + hours * 3600 + minutes * 60 + seconds
    return float(total) if total else math.inf


def walltime_seconds(value: str | float | None) -> float | None:
    """train.walltime in seconds: a number is seconds, text a Slurm time (parse_slurm_time); None: no limit."""
    if value is None or isinstance(value, str):
        return None if value is None else parse_slurm_time(value)
    if math.isnan(value) or value < 0:
        raise ValueError("not a time limit: give seconds (at least 0) or a Slurm time such as 02:00:00")
    return float(value)


def _parses(value: Any, parse: Any) -> Any:
    parse(value)  # a one-line ValueError if it does not
    return value


def slurm_time_text(value: Any, minutes: bool) -> Any:
    """A time limit as its text, the way Slurm reads it. YAML reads 1:30 as 90 and TOML 02:00:00 as a time of
    day (the config loader keeps YAML's base-60 numbers as text); a number is minutes if `minutes`, as in
    sbatch --time, else it stays a number (seconds)."""
    if isinstance(value, datetime.time):
        return value.isoformat()
    if minutes and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


MAX_NODES = 100_000  # more than any Slurm cluster has: a larger count is a typo, not a job
MAX_PER_NODE = 1024  # ranks or GPUs on one node: more than any node has (a typo, or a job that cannot start)
# slurm.python: a path or command name, as the job script runs it (quoted: nothing in it would expand)
PYTHON_COMMAND = re.compile(r"[A-Za-z0-9_./+@-]+")
JOB_NAME_MAX = 200  # squeue and sacct show far less: a longer job name is a mistake, not a label


def control_character(value: str) -> str | None:
    """The first control character in `value` (tabs aside), or None: in a job name or option such bytes reach
    every terminal that shows squeue, sacct or the job script, and can rewrite what it shows."""
    return next((c for c in value if unicodedata.category(c) == "Cc" and c != "\t"), None)


class SlurmConfig(Section):
    preset: ConfigPath = Field(
        "generic", description="Cluster preset: frontier, perlmutter, h100, a100, generic, or the path of your own "
        "preset YAML (modules, environment, GPUs per node, scratch root; see docs/slurm.md)."
    )
    account: str | None = Field(None, description="Allocation to charge (--account).")
    partition: str | None = Field(None, description="Partition (--partition); default: the preset's.")
    qos: str | None = Field(None, description="Quality of service (--qos); default: the preset's.")
    nodes: int = Field(1, gt=0, le=MAX_NODES, description=f"Nodes (--nodes), at most {MAX_NODES:,}.")
    gpus_per_node: int | None = Field(
        None, ge=0, le=MAX_PER_NODE, description="GPUs per node; default: the preset's (0 = CPU only)."
    )
    tasks_per_node: int | None = Field(
        None, gt=0, le=MAX_PER_NODE, description=f"Ranks per node, at most {MAX_PER_NODE}; default: one per GPU, "
        "or 1 on CPU-only nodes."
    )
    cpus_per_task: int | None = Field(None, gt=0, description="CPU cores per rank; default: the preset's.")
    time: SlurmTime = Field(
        "01:00:00", description=f"Time limit of each job, as sbatch --time takes it: {SLURM_TIME_FORMS} (a bare "
        "number is minutes), or UNLIMITED."
    )
    job_name: str | None = Field(
        None, description=f"Job name, at most {JOB_NAME_MAX} printable characters; default: the run name."
    )
    output: ConfigPath | None = Field(None, description="Job log path (%j = job id); default <run_dir>/slurm/%j.out.")
    signal_before: int = Field(
        300, ge=10, description="Seconds before the time limit that Slurm sends USR1 (--signal=B:USR1@N): the run "
        "saves and stops, then is requeued. Allow for one step plus one checkpoint."
    )
    launcher: Literal["srun", "torchrun"] = Field(
        "srun", description="srun: one task per rank (ranks from Slurm); torchrun: one srun task per node running "
        "torchrun."
    )
    requeue: Literal["requeue", "dependency", "none"] = Field(
        "requeue", description="When a job stops unfinished (signal, preemption, time limit): requeue the same job "
        "id (scontrol requeue), submit a follow-up job that depends on it, or leave it stopped."
    )
    max_restarts: int = Field(20, ge=0, description="Give up after this many restarts of one submission (a crash loop).")
    max_start_retries: int = Field(
        2, ge=0, description="Retry a job whose run failed before its first step (a rendezvous or NCCL "
        "initialisation timeout, a node that did not come up) this many times in a row, without the nodes "
        "`clustertrain doctor` named; 0: never. Exit code 2 (a bad config or file) is never retried."
    )
    modules: list[str] = Field(default_factory=list, description="Modules to load after the preset's.")
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment for the job, after the preset's; ${NAME} expands, nothing else "
        "does. Never put secrets here: export them before submitting (sbatch passes your environment on)."
    )
    setup: list[str] = Field(
        default_factory=list, description="Shell lines run before training, e.g. `source /path/venv/bin/activate`."
    )
    sbatch: dict[str, str | int | bool] = Field(
        default_factory=dict, description="More sbatch options, e.g. {constraint: nvme, mail-type: END}."
    )
    python: str | None = Field(
        None, description="Python that runs clustertrain on the nodes: a path or command name (no spaces or shell "
        "characters); default: the one rendering."
    )
    doctor: bool = Field(
        False, description="Run `clustertrain doctor` as a job step before training (as `slurm submit --doctor` "
        "does): every rank's software, environment, files, matmul speed and links; a failure stops the job before "
        "it trains, its findings in <run_dir>/doctor.json (see docs/doctor.md)."
    )

    @model_validator(mode="after")
    def _checks(self) -> SlurmConfig:
        if self.signal_before >= parse_slurm_time(self.time):
            raise ValueError(f"signal_before = {self.signal_before} s must be shorter than time = {self.time!r}")
        single_line = {"account": self.account, "partition": self.partition, "qos": self.qos,
                       "job_name": self.job_name, "output": self.output, "python": self.python,
                       **{f"modules.{i}": m for i, m in enumerate(self.modules)},
                       **{f"env.{k}": v for k, v in self.env.items()},
                       **{f"sbatch.{k}": str(v) for k, v in self.sbatch.items()}}
        for name, v in single_line.items():
            if v is not None and ("\n" in v or "\r" in v):
                raise ValueError(f"slurm.{name}: values must be one line each: a newline would end the #SBATCH line")
            if v is not None and (c := control_character(v)):
                raise ValueError(f"slurm.{name}: holds the control character {c!r}; use printable characters only")
        if self.python is not None and not (PYTHON_COMMAND.fullmatch(self.python) and self.python[0] != "-"):
            raise ValueError(f"slurm.python = {self.python[:80]!r} cannot be a python command: give its path or name "
                             "(letters, digits and . _ - + / @), e.g. /opt/venv/bin/python; set arguments elsewhere")
        if self.job_name is not None and len(self.job_name) > JOB_NAME_MAX:
            raise ValueError(f"slurm.job_name: {len(self.job_name):,} characters; at most {JOB_NAME_MAX}")
        for option in self.sbatch:
            if option in ("time", "t"):
                raise ValueError(f"sbatch: {option!r} is set by slurm.time (checked against slurm.signal_before); "
                                 "set slurm.time instead")
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9-]*", option):
                raise ValueError(f"sbatch: {option!r} is not an sbatch option name (letters, digits and -)")
        for name in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"env: {name!r} is not a valid environment variable name")
            if SECRET_NAME.search(name):
                raise ValueError(
                    f"env.{name} looks like a secret, and the job script must not hold one; export {name} in the "
                    "shell you submit from (sbatch passes your environment to the job)"
                )
        return self
