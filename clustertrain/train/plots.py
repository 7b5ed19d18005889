"""PNG charts of runs: loss, lr, throughput, MFU and memory curves from metrics.jsonl (several runs overlaid, a
run's resumes stitched), and a scaling study's tokens/s and efficiency.

    plot_runs([RunDir(Path("runs/a")), RunDir(Path("runs/b"))], Path("runs/compare.png"))
    plot_scaling(rows, Path("runs/scaling/scaling.png"))   # rows from clustertrain.launch.scaling.read_scaling

matplotlib is an optional extra (`pip install 'clustertrain[plot]'`); without it these raise a one-line UserError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clustertrain.errors import DataError, UserError
from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import read_metrics


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


# The panels of `plot_runs`: title, y label, and the metrics.jsonl keys drawn: the first solid, the second dashed
# (named in the label where drawn).
PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("loss", "loss", ("loss", "eval_loss")),
    ("learning rate", "lr", ("lr",)),
    ("throughput (all ranks)", "tokens/s", ("tokens_per_s",)),
    ("MFU", "% of peak FLOP/s", ("mfu",)),
    ("peak memory per rank", "GB", ("mem_gb", "mem_reserved_gb")),
)
_DASHED = {"eval_loss": "held-out", "mem_reserved_gb": "reserved"}
_SCALE = {"mfu": 100.0}  # drawn as a percentage
# Past this a value is a gap, as NaN and ±inf are: no loss, lr, tokens/s, MFU or GB comes near it, and an axis
# from -1e308 to 1e308 overflows matplotlib's tick arithmetic.
LARGEST = 1e100


@dataclass
class RunCurves:
    """What `plot_runs` draws of one run: each key's (step, value) points, steps ascending and each once, and the
    steps at which a later start of the run resumed."""

    name: str
    curves: dict[str, list[tuple[int, float]]]
    resumes: list[int] = field(default_factory=list)


def run_curves(run: RunDir, name: str | None = None) -> RunCurves:
    """The curves in the run's metrics.jsonl, its starts stitched together: a resumed run appends to the file, and
    where it did steps again (those after the checkpoint it resumed from), its later record of a step wins.
    A start is the record of `load_mem_gb`, logged at the step the start resumed from."""
    path = run.metrics
    if not path.exists() and not path.is_symlink():  # a FIFO, a device or a dangling link: read_metrics names it
        raise DataError(f"{path} does not exist: is {run.root} a run directory (train.run_dir)?")
    latest: dict[str, dict[int, float]] = {key: {} for _, _, keys in PANELS for key in keys}
    resumes = []
    for record in read_metrics(path):
        step = record["step"]
        if record.get("load_mem_gb") is not None and step > 0:
            resumes.append(step)
        for key, points in latest.items():
            if record.get(key) is not None:
                value = float(record[key]) * _SCALE.get(key, 1.0)
                points[step] = value if abs(value) <= LARGEST else math.nan  # NaN fails the test too
    curves = {key: sorted(points.items()) for key, points in latest.items()}
    return RunCurves(name or run.root.resolve().name, curves, resumes)


def plot_runs(run_dirs: Sequence[RunDir], out: Path) -> Path:
    """Loss (dashed: eval loss), lr, tokens/s, MFU and memory against the step, the panels of what was logged, one
    colour per run (resumes marked by a dotted line); returns `out`."""
    plt = pyplot()
    names = [d.root.resolve().name for d in run_dirs]
    runs = [run_curves(d, name if names.count(name) == 1 else str(d.root)) for d, name in zip(run_dirs, names)]
    panels = [panel for panel in PANELS if any(_drawn(run.curves[key]) for run in runs for key in panel[2])]
    if not panels:
        raise DataError(f"no loss or tokens/s logged yet in {', '.join(str(d.metrics) for d in run_dirs)}")
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax, (title, ylabel, keys) in zip(axes.flat, panels):
        for i, run in enumerate(runs):
            color = f"C{i % 10}"
            for key, style in zip(keys, ("-", "--")):
                if run.curves[key]:
                    ax.plot(*zip(*run.curves[key]), color=color, linestyle=style,
                            marker="o" if key == "eval_loss" else None, label=run.name if style == "-" else None)
            for step in run.resumes:
                ax.axvline(step, color=color, linestyle=":", alpha=0.6)
        dashed = [_DASHED[key] for key in keys[1:] if any(run.curves[key] for run in runs)]
        ax.set(xlabel="step", ylabel=ylabel + "".join(f" (dashed: {what})" for what in dashed), title=title)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small")  # the runs' colours, once
    for ax in axes.flat[len(panels):]:
        ax.remove()
    return _save(fig, plt, out)


def _drawn(points: list[tuple[int, float]]) -> bool:
    """Whether a curve has a point to draw: a panel of gaps only (NaN, ±inf, past LARGEST) is left out."""
    return any(not math.isnan(value) for _, value in points)


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
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(out, dpi=100)
    except OSError as e:  # a read-only folder, a file where a folder should be, a directory named like the file
        where = f": {e.filename}" if e.filename and str(e.filename) != str(out) else ""  # a folder on the way
        raise UserError(f"cannot write {out} ({e.strerror or e}{where}); give -o a path you can write") from None
    except ValueError as e:  # matplotlib: "Format 'xyz' is not supported (supported formats: ...)"
        raise UserError(f"cannot write {out}: {str(e).splitlines()[0]}") from None
    finally:
        plt.close(fig)
    return out
