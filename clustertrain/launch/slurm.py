"""Render a readable sbatch script from the run config's `slurm` section and its cluster preset.

The script is `templates/sbatch.sh` with its `@{name}` placeholders filled, the launcher's lines from
`templates/srun.sh` or `templates/torchrun.sh`.

Every value from a config or preset is shell-quoted: in `#SBATCH` lines (sbatch parses them with shell
quoting rules) and in the body. In environment values, `${NAME}` expands and nothing else does.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template

from clustertrain.config.schema import RunConfig
from clustertrain.config.slurm_schema import JOB_NAME_MAX, SlurmConfig, control_character
from clustertrain.errors import ConfigError
from clustertrain.launch.presets import Preset, load_preset, on_cluster
from clustertrain.run_dir import RunDir

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# Every GPU job, before the preset's and the config's own: the caching allocator grows segments instead of
# fragmenting (fewer OOMs at high memory use; ROCm builds read the same variable), and NCCL's flight recorder
# keeps the last collectives of each rank and dumps them into the run directory on a timeout
# (clustertrain.distributed.init names the file), so a hang names the collective and the rank that stalled.
GPU_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
           "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
COUNTED_CPUS = "${cpus_per_task}"  # the node's cores / its ranks, counted by the job script (templates/cpu-count.sh)
_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class JobSpec:
    """The job's shape once the preset's defaults are filled in."""

    nodes: int
    gpus_per_node: int
    tasks_per_node: int
    cpus_per_task: int | None  # None: the node's cores / tasks_per_node, counted by the job script at run time
    partition: str | None
    qos: str | None
    modules: list[str]
    env: dict[str, str]
    setup: list[str]
    sbatch: dict[str, str | int | bool]
    srun: list[str]

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def job_spec(slurm: SlurmConfig, preset: Preset | None = None) -> JobSpec:
    """Merge the preset (named by `slurm.preset` unless given) with the config's own slurm keys."""
    preset = preset or load_preset(slurm.preset)
    gpus = preset.gpus_per_node if slurm.gpus_per_node is None else slurm.gpus_per_node
    tasks = slurm.tasks_per_node or max(gpus, 1)
    cpus = slurm.cpus_per_task or preset.cpus_per_task
    if cpus is None and preset.cores_per_node:
        cpus = max(1, preset.cores_per_node // tasks)
    if cpus is None and gpus:
        cpus = 1  # a GPU rank's threads only feed its GPU
    env = {**OFFLINE_ENV, **(GPU_ENV if gpus else {}), "OMP_NUM_THREADS": str(cpus) if cpus else COUNTED_CPUS}
    if preset.scratch:
        env |= {"CLUSTERTRAIN_CACHE": f"{preset.scratch}/clustertrain", "HF_HOME": f"{preset.scratch}/huggingface"}
    return JobSpec(
        nodes=slurm.nodes,
        gpus_per_node=gpus,
        tasks_per_node=tasks,
        cpus_per_task=cpus,
        partition=slurm.partition or preset.partition,
        qos=slurm.qos or preset.qos,
        modules=[*preset.modules, *slurm.modules],
        env=env | preset.env | slurm.env,
        setup=[*preset.setup, *slurm.setup],
        sbatch=preset.sbatch | slurm.sbatch,
        srun=preset.srun,
    )


def shell_value(value: str) -> str:
    """Quote `value` for bash so that only `${NAME}` references expand.

    >>> shell_value("/scratch/${USER}/x y")
    '"/scratch/${USER}/x y"'
    >>> shell_value("$(rm -rf ~)")
    "'$(rm -rf ~)'"
    """
    parts = _REFERENCE.split(value)  # literal, name, literal, name, ..., literal
    literals = parts[0::2]
    if len(parts) == 1:
        return shlex.quote(value)
    if not any(c in lit for lit in literals for c in '"\\$`!'):
        return '"' + "".join(p if i % 2 == 0 else f"${{{p}}}" for i, p in enumerate(parts)) + '"'
    return "".join(shlex.quote(p) if i % 2 == 0 else f'"${{{p}}}"' for i, p in enumerate(parts) if p or i % 2)


def render_script(config: RunConfig, train_args: list[str], workdir: Path, source: str) -> str:
    """The sbatch script that trains `config` until done: `clustertrain train TRAIN_ARGS` under srun.

    Args:
        config: The resolved run config (its `slurm` section shapes the job).
        train_args: Arguments after `clustertrain train`: the config path and any --set overrides.
        workdir: Directory the job runs in (relative paths in the config resolve from here).
        source: Where the config came from, for the header comment.
    """
    slurm = config.slurm
    preset = load_preset(slurm.preset)
    spec = job_spec(slurm, preset)
    run = RunDir((workdir / config.run_dir).resolve())
    python = slurm.python or sys.executable
    if slurm.job_name is None and len(config.name) > JOB_NAME_MAX:  # the run name is the job's
        raise ConfigError(f"name: {len(config.name):,} characters is too long for a Slurm job name (at most "
                          f"{JOB_NAME_MAX}); set slurm.job_name, or a shorter name")
    _check_one_line({"name": config.name, "train.run_dir": str(run.root), "the working directory": str(workdir),
                     "the config path": source, "slurm.python": python})
    for argument in train_args:
        _check_one_line({"an argument of clustertrain train": argument})
    cpu_count = ""  # CPU-only nodes count their cores at run time, in a block after a blank line
    if spec.cpus_per_task is None:
        cpu_count = "\n" + _fill("cpu-count.sh", tasks_per_node=spec.tasks_per_node)
    return _fill(
        "sbatch.sh", name=repr(config.name), source=source, preset=slurm.preset, description=preset.description,
        sbatch="\n".join(f"#SBATCH {option}" for option in _sbatch_options(config, spec, run, workdir)),
        cpu_count=cpu_count, environment=_environment(spec), python=shlex.quote(python),
        run_dir=shlex.quote(str(run.root)), user_error_note=shlex.quote(str(run.user_error_note)),
        on_stop=slurm.requeue, max_restarts=slurm.max_restarts,
        max_start_retries=slurm.max_start_retries,
        doctor=_doctor(slurm, spec, train_args, run), launch=_launch(slurm, spec, ["train", *train_args]),
    )


class _Script(Template):
    """A job script template: `@{name}` placeholders, so that the shell's own `$` stays as written."""

    delimiter = "@"


def _fill(template: str, **values: object) -> str:
    """`templates/TEMPLATE` with its placeholders filled."""
    return _Script(resources.files(__package__).joinpath("templates", template).read_text()).substitute(values)


def environment_lines(slurm: SlurmConfig) -> str:
    """The module loads, exports and setup lines a job script of `slurm` runs before its ranks start: for an
    interactive allocation (`clustertrain env CONFIG`, then `eval` it), the same as the script's.

    Only the job script counts a CPU-only node's cores (`cpus_per_task`); here OMP_NUM_THREADS is the cores
    Slurm gave this shell's node over its ranks, and left unset outside an allocation, never set empty.
    """
    spec = job_spec(slurm)
    if spec.env.get("OMP_NUM_THREADS") != COUNTED_CPUS:
        return _environment(spec) + "\n"
    env = {name: value for name, value in spec.env.items() if name != "OMP_NUM_THREADS"}
    tasks = spec.tasks_per_node
    omp = (f"[ -z \"${{SLURM_CPUS_ON_NODE:-}}\" ] || export OMP_NUM_THREADS=$(( SLURM_CPUS_ON_NODE / {tasks} > 1 ? "
           f"SLURM_CPUS_ON_NODE / {tasks} : 1 ))  # the node's cores / {tasks} rank(s), as the job script counts")
    return _environment(dataclasses.replace(spec, env=env)) + "\n" + omp + "\n"


def _environment(spec: JobSpec) -> str:
    """Module loads, exports and setup lines: the preset's, then the config's."""
    if spec.modules:
        lines = ["# Modules and environment: the preset's, then slurm.modules and slurm.env. Nodes run offline.",
                 "module load " + " ".join(map(shlex.quote, spec.modules))]
    else:
        lines = ["# Environment: the preset's, then slurm.env. Compute nodes run offline."]
    lines += [f"export {name}={shell_value(value)}" for name, value in spec.env.items()]
    return "\n".join(lines + spec.setup)


def environment_problems(slurm: SlurmConfig, environ: Mapping[str, str]) -> list[str]:
    """One line per variable the preset (or slurm.env) sets that `environ` lacks or holds otherwise, when this
    process runs on the preset's cluster (presets.on_cluster); elsewhere none. A value with `${NAME}` references
    is checked only for presence: its expansion depends on the job (SLURM_JOB_ID, the user, the variable's own
    earlier value)."""
    preset = load_preset(slurm.preset)
    if not on_cluster(preset, environ):
        return []
    problems = []
    for name, value in (preset.env | slurm.env).items():
        who = "slurm.env" if name in slurm.env else f"the {slurm.preset} preset"
        if name not in environ:
            problems.append(f"{name} is not set; {who} sets {value}")
        elif not _REFERENCE.search(value) and environ[name] != value:
            problems.append(f"{name} is {environ[name]}; {who} sets {value}")
    return problems


def rank_start_warnings(config_path: str | None, slurm: SlurmConfig, environ: Mapping[str, str]) -> list[str]:
    """What rank 0 of a run started by hand (srun, torchrun, mpirun: not `--nproc`, not plain python) on the
    preset's cluster warns of: one line per variable of the preset missing from its environment. The job script
    exports them all, so its ranks say nothing."""
    from clustertrain.distributed.env import detect_launcher
    from clustertrain.errors import UserError

    try:
        info = detect_launcher(environ)
    except UserError:  # the trainer reports it
        return []
    # `--nproc` exports torchrun's RANK and WORLD_SIZE too, but not torchrun's TORCHELASTIC_RUN_ID
    by_hand = info.launcher != "single" and (info.launcher != "torchrun" or "TORCHELASTIC_RUN_ID" in environ)
    if not by_hand or info.rank != 0:
        return []
    how = f'eval "$(clustertrain env{" " + config_path if config_path else ""})" in an salloc shell sets them all'
    return [f"warning: {problem} ({how})" for problem in environment_problems(slurm, environ)]


def _doctor(slurm: SlurmConfig, spec: JobSpec, train_args: list[str], run: RunDir) -> str:
    """With slurm.doctor: the step that runs `clustertrain doctor` on every rank before training, its findings in
    <run_dir>/doctor.json. A failure ends the job before it trains; job-end takes it for a failed start (retried
    without the doctor's bad_hosts, launch/jobs.py)."""
    if not slurm.doctor:
        return ""
    report = shlex.quote(str(run.doctor))
    step = _launch(slurm, spec, ["doctor", *train_args, "--output", report], then=' || end_job "$?"')
    return ("# slurm.doctor: check every rank (software, environment, files, matmul, links) before training; a\n"
            f"# failure stops here. See {report}: bad_hosts lists the nodes to --exclude.\n{step}\n")


def _launch(slurm: SlurmConfig, spec: JobSpec, args: list[str], then: str = " &") -> str:
    """The srun line that starts the ranks running `clustertrain ARGS` (in the background), from
    `templates/LAUNCHER.sh`; `then` ends the line."""
    q = shlex.quote
    train = " ".join(map(q, ["-m", "clustertrain", *args]))
    # srun takes --cpus-per-task itself: since Slurm 22.05 it no longer inherits sbatch's
    if slurm.launcher == "srun":
        per_rank = spec.cpus_per_task or '"$cpus_per_task"'
        srun = [*map(q, ["srun", f"--ntasks-per-node={spec.tasks_per_node}"]), f"--cpus-per-task={per_rank}",
                *map(q, [*spec.srun, "--kill-on-bad-exit=1"])]
    else:
        per_node = (spec.cpus_per_task * spec.tasks_per_node if spec.cpus_per_task
                    else f'"$(( cpus_per_task * {spec.tasks_per_node} ))"')
        srun = ["srun", "--ntasks-per-node=1", f"--cpus-per-task={per_node}", "--kill-on-bad-exit=1"]
    return _fill(f"{slurm.launcher}.sh", srun=" ".join(srun), train=train, tasks_per_node=spec.tasks_per_node,
                 signal_before=slurm.signal_before, then=then).removesuffix("\n")


def _check_one_line(values: dict[str, str]) -> None:
    """Refuse a value with a line break: quoting keeps a value literal, but a newline still ends a `#SBATCH`
    line (and with it the option block: later options such as --signal and --requeue would be dropped). Other
    control characters are refused too: they reach every terminal that shows the script, squeue or sacct."""
    for key, value in values.items():
        if "\n" in value or "\r" in value:
            raise ConfigError(f"{key} = {value[:80]!r} holds a line break, which would end a line of the job script; "
                              "use one line")
        if c := control_character(value):
            raise ConfigError(f"{key} holds the control character {c!r}; use printable characters only")


def _sbatch_options(config: RunConfig, spec: JobSpec, run: RunDir, workdir: Path) -> list[str]:
    """`--key=value` (quoted) or `--flag` for each #SBATCH line; unset values are left out."""
    slurm = config.slurm
    per_node = 1 if slurm.launcher == "torchrun" else spec.tasks_per_node
    options: dict[str, object] = {
        "job-name": slurm.job_name or config.name,
        "account": slurm.account,
        "partition": spec.partition,
        "qos": spec.qos,
        "nodes": spec.nodes,
        "ntasks-per-node": per_node,
        "gpus-per-node": spec.gpus_per_node or None,
        "cpus-per-task": spec.cpus_per_task * spec.tasks_per_node // per_node if spec.cpus_per_task else None,
        "exclusive": spec.cpus_per_task is None,  # whole nodes, whose cores the script counts
        "time": slurm.time,
        "output": slurm.output or str(run.job_log("%j")),
        "open-mode": "append",  # a requeued job keeps its id and its log: append, do not overwrite
        "chdir": str(workdir.resolve()),
        "signal": f"B:USR1@{slurm.signal_before}",
        "requeue": slurm.requeue == "requeue",
        **spec.sbatch,
    }
    return [f"--{key}" if value is True else f"--{key}={shlex.quote(str(value))}"
            for key, value in options.items() if value is not None and value is not False]
