"""A scaling study on one's own cluster: the same short run at several node counts, and how its throughput grows.

    clustertrain slurm submit configs/opt-pp-lora-cpu.yaml --scaling 1,2,4,8 --steps 30
    clustertrain slurm scaling runs/opt-pp-lora-cpu          # table + runs/opt-pp-lora-cpu/scaling.png

Each count runs in `<run_dir>/scaling-N<nodes>/` with the same global batch (a config that gives the batch per
rank, micro_batch_size x grad_accum, is pinned to the global batch it has at the largest count), so that every
count does the same work per step and tokens/s compare. Scaling efficiency at N nodes is
(tokens/s at N / N) / (tokens/s at the smallest count n0 / n0): 100% is perfect linear scaling.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from clustertrain.config.layout import check_world, resolve_layout
from clustertrain.config.schema import RunConfig
from clustertrain.errors import ConfigError, DataError, LaunchError
from clustertrain.launch import jobs
from clustertrain.launch.slurm import job_spec
from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import read_metrics


def parse_counts(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]: node counts, positive, each once, ascending."""
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise ConfigError(f"--scaling {text!r}: give node counts separated by commas, e.g. --scaling 1,2,4,8")
    return counts


def scaling_configs(config: RunConfig, counts: list[int], steps: int | None, workdir: Path) -> dict[int, RunConfig]:
    """The run config of each node count: its own run directory and name, the same global batch and steps.

    Raises:
        ConfigError: listing, for every count that does not fit, why (e.g. a global batch that its ranks do not
            divide).
    """
    base = config
    tasks = job_spec(base.slurm).tasks_per_node
    if steps is not None:
        base = base.updated(train={"tokens": None, "epochs": None, "steps": steps})
    if base.train.grad_accum is not None:  # the batch per rank would grow with the ranks: pin the largest's
        layout = resolve_layout(base, counts[-1] * tasks, tasks)
        base = base.updated(train={"grad_accum": None, "global_batch_size": layout.global_batch})
    run = RunDir((workdir / base.run_dir).resolve())
    configs, problems = {}, []
    for nodes in counts:
        each = base.updated(slurm={"nodes": nodes}, name=f"{base.name}-N{nodes}",
                            train={"run_dir": str(run.scaling_run(nodes))})
        problems += [f"{nodes} node(s): {p}" for p in check_world(each, nodes * tasks, tasks)]
        configs[nodes] = each
    if problems:
        raise ConfigError("the scaling runs do not all fit: " + "; ".join(problems))
    return configs


def submit_scaling(config: RunConfig, counts: list[int], steps: int | None, workdir: Path,
                   source: str) -> list[tuple[int, str, Path]]:
    """Submit one job per node count; returns (nodes, job id, script) for each."""
    return [(nodes, *jobs.submit(each, workdir, source))
            for nodes, each in scaling_configs(config, counts, steps, workdir).items()]


@dataclass(frozen=True)
class ScalingRow:
    """One node count of a scaling study; `tokens_per_s` is None until its run has logged past the warm-up."""

    nodes: int
    ranks: int | None
    steps: int  # steps measured, after the warm-up
    tokens_per_s: float | None
    efficiency: float | None  # per-node tokens/s relative to the smallest measured count

    @property
    def tokens_per_s_per_node(self) -> float | None:
        return self.tokens_per_s / self.nodes if self.tokens_per_s else None


def read_scaling(run_dir: Path, warmup_steps: int = 5) -> list[ScalingRow]:
    """The throughput of each `scaling-N*` run under `run_dir`, from its metrics.jsonl after `warmup_steps`.

    Tokens/s is the tokens of the measured log intervals over their time (each interval's tokens over its rate),
    so that intervals of different lengths weigh by their time.
    """
    run = RunDir(run_dir)
    counts = run.scaling_runs()
    if not counts:
        raise LaunchError(f"{run_dir} has no scaling-N<nodes> runs; submit them with "
                          "`clustertrain slurm submit CONFIG --scaling 1,2,4`")
    measured = {nodes: _throughput(RunDir(run.scaling_run(nodes)), warmup_steps) for nodes in counts}
    base = next(((n, tps) for n, (_, _, tps) in measured.items() if tps), None)
    rows = []
    for nodes, (ranks, steps, tps) in measured.items():
        efficiency = tps / nodes / (base[1] / base[0]) if tps and base else None
        rows.append(ScalingRow(nodes, ranks, steps, tps, efficiency))
    return rows


def _throughput(sub_run: RunDir, warmup_steps: int) -> tuple[int | None, int, float | None]:
    """(ranks, steps measured, tokens/s) of one run; (ranks, 0, None) before it has logged past the warm-up."""
    path = sub_run.metrics
    records = [r for r in read_metrics(path) if r.get("tokens_per_s")] if path.is_file() else []
    ranks = _ranks(sub_run, records)
    tokens = seconds = 0.0
    first_step = None
    for before, record in zip(records, records[1:]):
        if before["step"] < warmup_steps:
            continue
        first_step = before["step"] if first_step is None else first_step
        interval = record["tokens"] - before["tokens"]
        tokens += interval
        seconds += interval / record["tokens_per_s"]
    if not seconds:
        return ranks, 0, None
    return ranks, records[-1]["step"] - first_step, tokens / seconds


def _ranks(sub_run: RunDir, records: list[dict]) -> int | None:
    """The run's rank count: from its logged throughput per rank, else from its job's config snapshot."""
    for record in records:
        if record.get("tokens_per_s_per_rank"):
            return round(record["tokens_per_s"] / record["tokens_per_s_per_rank"])
    snapshot = sub_run.slurm_config
    try:
        slurm = yaml.safe_load(snapshot.read_text())["slurm"]
        return slurm["nodes"] * (slurm.get("tasks_per_node") or 1)
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None


def format_table(rows: list[ScalingRow]) -> str:
    """The scaling table as aligned text."""
    header = ("nodes", "ranks", "steps", "tokens/s", "tokens/s/node", "efficiency")
    lines = [header]
    for row in rows:
        if row.tokens_per_s is None:
            lines.append((str(row.nodes), str(row.ranks or "?"), "0", "-", "-", "not measured yet"))
            continue
        lines.append((str(row.nodes), str(row.ranks or "?"), str(row.steps), f"{row.tokens_per_s:,.0f}",
                      f"{row.tokens_per_s_per_node:,.0f}", f"{100 * row.efficiency:.0f}%"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in lines)


def require_measured(rows: list[ScalingRow], run_dir: Path, warmup_steps: int) -> None:
    """Refuse a report with nothing measured, naming what to wait for."""
    if not any(row.tokens_per_s for row in rows):
        raise DataError(f"no scaling run under {run_dir} has logged throughput past step {warmup_steps} yet: wait for "
                        "the jobs (clustertrain slurm status RUN_DIR/scaling-N<nodes>), or lower --warmup-steps")
