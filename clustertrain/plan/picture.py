"""The picture of one plan or of several (`clustertrain plan --plot`): memory per rank by component, and step
time by part, side by side for each layout."""

from __future__ import annotations

from pathlib import Path

from clustertrain.errors import UserError

MEMORY_PARTS = (("params", "parameters"), ("optimizer", "optimizer states"), ("buckets", "DDP buckets"),
                ("step_peak", "step (activations, gathered weights, temps)"))


def draw(plans: list[tuple[str, object]], path: str | Path, title: str) -> Path:
    """Write a PNG of `plans` ((label, Plan) pairs) to `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plan --plot needs matplotlib: pip install 'clustertrain[plot]'") from None
    labels = [label for label, _ in plans]
    fig, (memory, time) = plt.subplots(1, 2, figsize=(11, 4.5))
    bottom = [0.0] * len(plans)
    for key, name in MEMORY_PARTS:  # the largest stage of each plan
        values = [getattr(max(plan.stages, key=lambda s: s.peak), key) / 1e9 for _, plan in plans]
        memory.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    device = plans[0][1].device
    if device.memory_bytes:
        memory.axhline(device.memory_bytes / 1e9, color="black", linestyle="--", label=f"{device.name} memory")
    memory.set(ylabel="GB per rank", title="peak memory per rank")
    memory.legend(fontsize=7)
    compute = [(plan.compute_s or 0) / (1 - plan.bubble) for _, plan in plans]
    time.bar(labels, compute, label="compute (with pipeline idle)")
    exposed = [max(0.0, sum(s or 0 for d, s in plan.comm_s.items() if d.startswith("dp")) - busy)
               for (_, plan), busy in zip(plans, compute)]
    time.bar(labels, exposed, bottom=compute, label="data-parallel traffic beyond the compute")
    bottom = [c + e for c, e in zip(compute, exposed)]
    for dim in sorted({dim for _, plan in plans for dim in plan.comm_s if not dim.startswith("dp")}):
        values = [plan.comm_s.get(dim) or 0 for _, plan in plans]
        time.bar(labels, values, bottom=bottom, label=f"{dim} traffic")
        bottom = [b + v for b, v in zip(bottom, values)]
    time.set(ylabel="seconds", title="step time by part")
    time.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    except OSError as e:  # a folder that is read-only, missing rights, a directory named like the file
        where = f": {e.filename}" if e.filename and str(e.filename) != str(path) else ""  # a folder on the way
        raise UserError(f"plan --plot: cannot write {path} ({e.strerror or e}{where}); give a path you can write") \
            from None
    except ValueError as e:  # matplotlib: "Format 'xyz' is not supported (supported formats: ...)"
        raise UserError(f"plan --plot: cannot write {path}: {str(e).splitlines()[0]}") from None
    finally:
        plt.close(fig)
    return path
