"""`clustertrain plot RUN_DIR [RUN_DIR...]`: loss, lr, tokens/s, MFU and memory curves of one or several runs, as
a PNG.

    clustertrain plot runs/tiny-llama                               # runs/tiny-llama/curves.png
    clustertrain plot runs/lr-1e-3 runs/lr-3e-3 -o compare.png      # several runs, one colour each

Reads each run's metrics.jsonl: training loss (and eval loss, dashed, where logged), learning rate, tokens/s, MFU
and peak memory per step, the panels of what was logged. A resumed run's starts are stitched into one curve (a
dotted line where it resumed; steps done again after a restart: the later record wins).
Needs matplotlib: pip install 'clustertrain[plot]'.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plot", help="draw the loss, lr, tokens/s, MFU and memory curves of runs as a PNG",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories (train.run_dir)")
    parser.add_argument("-o", "--output", type=Path,
                        help="the PNG to write (default: RUN_DIR/curves.png of the first run)")
    parser.set_defaults(run=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    from clustertrain.run_dir import RunDir
    from clustertrain.train.plots import plot_runs

    runs = [RunDir(path) for path in args.run_dirs]
    out = plot_runs(runs, args.output or runs[0].curves_plot)
    print(f"wrote {out}")
    return 0
