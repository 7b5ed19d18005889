"""PNG charts of runs: loss and throughput curves from metrics.jsonl, and a scaling study's tokens/s and efficiency.

    plot_runs([Path("runs/a"), Path("runs/b")], Path("runs/compare.png"))
    plot_scaling(rows, Path("runs/scaling/scaling.png"))   # rows from clustertrain.launch.scaling.read_scaling

matplotlib is an optional extra (`pip install 'clustertrain[plot]'`); without it these raise a one-line UserError.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clustertrain.errors import DataError, UserError
from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import read_jsonl


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (no display on cluster nodes), or a UserError saying how
    to install it."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("plotting needs matplotlib, which is not installed: pip install 'clustertrain[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) points of loss, eval_loss and tokens_per_s logged in `run_dir/metrics.jsonl`."""
    path = RunDir(run_dir).metrics
    if not path.is_file():
        raise DataError(f"{path} does not exist: is {run_dir} a run directory (train.run_dir)?")
    curves: dict[str, list[tuple[int, float]]] = {"loss": [], "eval_loss": [], "tokens_per_s": []}
    for record in read_jsonl(path):
        for key, points in curves.items():
            if record.get(key) is not None:
                points.append((record["step"], float(record[key])))
    return curves


def plot_runs(run_dirs: Sequence[Path], out: Path) -> Path:
    """Loss (dashed: eval loss, where logged) and tokens/s against the step, one colour per run; returns `out`."""
    plt = pyplot()
    curves = {run_dir: run_curves(run_dir) for run_dir in run_dirs}
    if not any(points for run in curves.values() for points in run.values()):
        raise DataError(f"no loss or tokens/s logged yet in {', '.join(str(RunDir(d).metrics) for d in run_dirs)}")
    fig, (loss_ax, speed_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (run_dir, run) in enumerate(curves.items()):
        color, label = f"C{i % 10}", run_dir.resolve().name
        if run["loss"]:
            loss_ax.plot(*zip(*run["loss"]), color=color, label=label)
        if run["eval_loss"]:
            loss_ax.plot(*zip(*run["eval_loss"]), color=color, linestyle="--", marker="o", label=f"{label} (eval)")
        if run["tokens_per_s"]:
            speed_ax.plot(*zip(*run["tokens_per_s"]), color=color, label=label)
    loss_ax.set(xlabel="step", ylabel="loss", title="loss")
    speed_ax.set(xlabel="step", ylabel="tokens/s", title="throughput (all ranks)")
    for ax in (loss_ax, speed_ax):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    return _save(fig, plt, out)


def plot_scaling(rows: Sequence[Any], out: Path) -> Path:
    """Tokens/s per node count against perfect scaling from the smallest count, and the scaling efficiency.

    `rows` have `nodes`, `tokens_per_s` and `efficiency` (clustertrain.launch.scaling.ScalingRow, a layer above).
    """
    plt = pyplot()
    measured = [row for row in rows if row.tokens_per_s]
    nodes = [row.nodes for row in measured]
    fig, (speed_ax, eff_ax) = plt.subplots(1, 2, figsize=(11, 4))
    speed_ax.plot(nodes, [row.tokens_per_s for row in measured], marker="o", label="measured")
    base = measured[0]
    speed_ax.plot(nodes, [base.tokens_per_s * n / base.nodes for n in nodes], linestyle="--", color="grey",
                  label=f"perfect scaling from {base.nodes} node(s)")
    speed_ax.set(xlabel="nodes", ylabel="tokens/s", title="throughput")
    eff_ax.plot(nodes, [100 * row.efficiency for row in measured], marker="o")
    eff_ax.axhline(100, linestyle="--", color="grey")
    top = max(110, *(100 * row.efficiency + 10 for row in measured))  # superlinear scaling happens (caches)
    eff_ax.set(xlabel="nodes", ylabel="% of perfect scaling", title="scaling efficiency", ylim=(0, top))
    for ax in (speed_ax, eff_ax):
        ax.set_xticks(nodes)
        ax.grid(alpha=0.3)
    speed_ax.legend(fontsize="small")
    return _save(fig, plt, out)


def _save(fig: Any, plt: Any, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
