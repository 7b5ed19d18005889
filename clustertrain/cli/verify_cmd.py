"""`clustertrain verify [CONFIG]`: prove a parallel layout right against plain data parallelism on one rank.

    clustertrain verify configs/tiny-llama.yaml --nproc 2 --set parallel.strategy=zero3
    clustertrain verify configs/zero3-bf16.toml --nproc 8 --steps 6 --out runs/verify-zero3
    clustertrain verify big.yaml --nproc 8 --reference-nproc 2 --reference-set parallel.strategy=zero3

Runs a few training steps of CONFIG twice, with the same data and seed: under its own layout on --nproc ranks,
and under the reference layout (parallel.strategy=ddp, every other layout key at its default) on
--reference-nproc ranks. Then compares the training loss and gradient norm of every step. Exit 0 when the
largest relative difference is within the tolerance for parallel.param_dtype, 1 when it is not.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from clustertrain.run_dir import RunDir

if TYPE_CHECKING:
    from clustertrain.config.schema import ParallelConfig

# Largest relative difference of loss and gradient norm that still passes, by parallel.param_dtype. A correct
# layout adds the same numbers in another order (sharded reductions, all-reduce trees, micro-batches), so it agrees
# only to the rounding of the compute dtype, which a few Adam steps amplify. Measured on a tiny Llama, zero3 on 2
# ranks against 1: 9e-8 in float32, 3e-3 in bfloat16 (docs/verify.md). A real bug (a gradient summed instead of
# averaged, a wrong loss scale) moves the loss or the gradient norm by far more.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 2e-2}

# ParallelConfig fields that describe the layout. The reference resets each one the schema has to its default.
LAYOUT_KEYS = ("tp", "sequence_parallel", "pp", "dp_shard", "dp_replicate", "hybrid_shard_size")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "verify", help="check a parallel layout: a few steps under it and on 1 rank, losses and grad norms compared",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", nargs="?", help="YAML or TOML config; omit for the embedded default")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for both runs, e.g. parallel.strategy=zero3")
    parser.add_argument("--nproc", type=int, default=2, metavar="N", help="ranks of the layout run (default 2)")
    parser.add_argument("--steps", type=int, default=4, metavar="K", help="training steps of each run (default 4)")
    parser.add_argument("--reference-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for the reference run only, after its layout reset (a model too big for 1 "
                             "rank: parallel.strategy=zero3 with --reference-nproc)")
    parser.add_argument("--reference-nproc", type=int, default=1, metavar="M",
                        help="ranks of the reference run (default 1)")
    parser.add_argument("--tolerance", type=float, default=None, metavar="X",
                        help="largest relative difference that passes (default by parallel.param_dtype: "
                             + ", ".join(f"{dtype} {tol:.0e}" for dtype, tol in TOLERANCE.items()) + ")")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="keep the runs in DIR/layout and DIR/reference, replacing earlier verify runs there "
                             "(default: a new temporary directory)")
    parser.set_defaults(run=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    from clustertrain.distributed.env import detect_launcher
    from clustertrain.errors import ConfigError, LaunchError, UserError
    from clustertrain.resolve.load import load_checked_config

    for flag in ("nproc", "steps", "reference_nproc"):
        value = getattr(args, flag)
        if value < 1:
            raise UserError(f"--{flag.replace('_', '-')} {value}: must be at least 1")
    if args.tolerance is not None and not args.tolerance > 0:
        raise UserError(f"--tolerance {args.tolerance}: must be greater than 0")
    if detect_launcher().world_size > 1:
        raise LaunchError("verify starts its own ranks (--nproc, --reference-nproc); run it as one process, not "
                          "under torchrun, mpirun or a multi-task srun")

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="clustertrain-verify-"))
    layout_overrides = [*args.set, *verify_overrides(args.steps, out / "layout")]
    reference_overrides = [*args.set, *reference_resets(), *args.reference_set,
                           *verify_overrides(args.steps, out / "reference")]
    # Both configs are validated here, so a bad key fails before any rank starts.
    try:
        layout = load_checked_config(args.config, layout_overrides)
        try:
            reference = load_checked_config(args.config, reference_overrides)
        except ConfigError as e:
            raise ConfigError(f"reference run: {e}") from None
    except UserError:
        if not args.out:
            out.rmdir()  # the temporary directory made above, still empty
        raise

    out.mkdir(parents=True, exist_ok=True)
    for name in ("layout", "reference"):  # before either run: a folder that is not ours stops verify at once
        clear_run_dir(out / name, out / f"{name}.log")
    print(f"runs kept in {out} (layout/, reference/ and their .log files)", flush=True)
    runs = {}
    for name, config, nproc, overrides in (("layout", layout, args.nproc, layout_overrides),
                                           ("reference", reference, args.reference_nproc, reference_overrides)):
        print(f"{name}: {nproc} rank{'s' if nproc > 1 else ''}, {describe_layout(config.parallel)}, "
              f"{args.steps} steps -> {out / name}", flush=True)
        code = run_training(args.config, nproc, overrides, out, name)
        if code != 0:
            return code
        runs[name] = logged_steps(RunDir(out / name))
    dtype = compute_dtype(layout.parallel)
    tolerance = args.tolerance if args.tolerance is not None else TOLERANCE[dtype]
    return compare(runs["layout"], runs["reference"], tolerance,
                   f"for {dtype}" if args.tolerance is None else "(--tolerance)")


def verify_overrides(steps: int, run_dir: Path) -> list[str]:
    """Keys every verify run sets last: K logged steps, nothing else to do, a run directory of its own."""
    return [
        f"train.steps={steps}", "train.tokens=null", "train.stop_after_steps=null", "train.eval_every=0",
        "train.sample_tokens=0", "train.resume=none", f"train.run_dir={json.dumps(str(run_dir))}",
        "metrics.log_every=1", "metrics.tensorboard=false", "metrics.progress=lines",
        # Only the final checkpoint, which the trainer always writes; run_training removes it.
        "checkpoint.every=0", "checkpoint.async=false",
    ]


def reference_resets() -> list[str]:
    """Overrides that turn any layout into plain data parallelism: ddp, and every layout key at its default."""
    from clustertrain.config.schema import ParallelConfig

    resets = ["parallel.strategy=ddp"]
    for key in LAYOUT_KEYS:
        field = ParallelConfig.model_fields.get(key)
        if field is not None:  # keys the schema does not have (yet) are no layout to reset
            resets.append(f"parallel.{key}={json.dumps(field.get_default(call_default_factory=True))}")
    return resets


def describe_layout(parallel: ParallelConfig) -> str:
    """`zero3, hybrid_shard_size=2, float32`: the strategy, the layout keys away from their defaults, the dtype."""
    from clustertrain.config.schema import ParallelConfig

    parts = [parallel.strategy]
    for key in LAYOUT_KEYS:
        field = ParallelConfig.model_fields.get(key)
        if field is not None and getattr(parallel, key) != field.get_default(call_default_factory=True):
            parts.append(f"{key}={getattr(parallel, key)}")
    return ", ".join([*parts, compute_dtype(parallel)])


def compute_dtype(parallel: ParallelConfig) -> str:
    """`parallel.param_dtype` as the runs resolve it on this machine's devices (auto: bfloat16 on a GPU)."""
    from clustertrain.distributed.init import device_type
    from clustertrain.hardware import param_dtype_for

    return param_dtype_for(parallel.param_dtype, device_type(parallel))


def run_training(config: str | None, nproc: int, overrides: list[str], out: Path, name: str) -> int:
    """Run `clustertrain train` into OUT/NAME with its output in OUT/NAME.log; 0, or 1 after showing why not.

    Raises:
        UserError: the run stopped on a user error (exit 2); its message, prefixed with the run's name.
    """
    from clustertrain.errors import UserError

    run, log = RunDir(out / name), out / f"{name}.log"
    command = [sys.executable, "-m", "clustertrain", "train", *([config] if config else []), "--nproc", str(nproc),
               *(f"--set={o}" for o in overrides)]
    start = time.perf_counter()
    with log.open("w") as stdout:
        result = subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, text=True, errors="replace")
    with log.open("a") as f:
        f.write(result.stderr)
    shutil.rmtree(run.checkpoints, ignore_errors=True)  # a model-sized folder nobody needs
    lines = result.stderr.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    if result.returncode == 2 and errors:  # the message that `main` printed, one line per problem
        message = "\n".join(lines[errors[-1]:]).strip().removeprefix("error: ")
        raise UserError(f"{name} run: {message}")
    if result.returncode != 0:
        tail = lines[-20:]
        print(f"{name} run failed with exit code {result.returncode}; the end of its output ({log}):",
              *(f"  {line}" for line in tail), sep="\n", file=sys.stderr)
        return 1
    print(f"  done in {time.perf_counter() - start:.0f} s (log: {log})", flush=True)
    return 0


def clear_run_dir(run_dir: Path, log: Path) -> None:
    """Remove an earlier verify run from OUT/NAME; a folder that verify did not make is left alone."""
    from clustertrain.errors import UserError

    if run_dir.exists() and any(run_dir.iterdir()):
        if not log.exists():
            raise UserError(f"{run_dir} exists and is not a verify run; give --out a new or empty directory")
        shutil.rmtree(run_dir)
    log.unlink(missing_ok=True)


def logged_steps(run: RunDir) -> dict[int, dict]:
    """step -> the metrics record with the training loss and gradient norm of that step."""
    from clustertrain.train.metrics import read_metrics

    return {r["step"]: r for r in read_metrics(run.metrics) if r.get("loss") is not None}


def relative_difference(value: float, reference: float) -> float:
    """|value - reference| / |reference|; inf when either is NaN or infinite, or only the reference is 0."""
    if not (math.isfinite(value) and math.isfinite(reference)):
        return math.inf
    if value == reference:
        return 0.0
    return abs(value - reference) / abs(reference) if reference else math.inf


def compare(layout: dict[int, dict], reference: dict[int, dict], tolerance: float, why: str) -> int:
    """Print the per-step table and, last, the largest relative difference; 0 within `tolerance`, else 1."""
    if not layout or layout.keys() != reference.keys():
        print(f"the runs logged different steps: layout {sorted(layout)}, reference {sorted(reference)}: FAIL")
        return 1
    header = ("step", "loss (layout)", "loss (reference)", "rel diff", "grad norm (layout)", "grad norm (ref)",
              "rel diff")
    print(f"{header[0]:>4}  {header[1]:>14}  {header[2]:>16}  {header[3]:>8}  {header[4]:>18}  {header[5]:>15}  "
          f"{header[6]:>8}")
    largest = {"loss": 0.0, "grad_norm": 0.0}
    for step in sorted(layout):
        row = [step]
        for key in ("loss", "grad_norm"):
            value, ref = layout[step][key], reference[step][key]
            diff = relative_difference(value, ref)
            largest[key] = max(largest[key], diff)
            row += [value, ref, diff]
        print(f"{row[0]:>4}  {row[1]:>14.8g}  {row[2]:>16.8g}  {row[3]:>8.1e}  {row[4]:>18.8g}  {row[5]:>15.8g}  "
              f"{row[6]:>8.1e}")
    worst = max(largest.values())
    shown = f"{tolerance:.0e}" if float(f"{tolerance:.0e}") == tolerance else f"{tolerance:.2e}"
    verdict = "PASS" if worst <= tolerance else "FAIL"
    print(f"largest relative difference: {worst:.1e} (loss {largest['loss']:.1e}, grad_norm "
          f"{largest['grad_norm']:.1e}); tolerance {shown} {why}: {verdict}", flush=True)
    return 0 if verdict == "PASS" else 1
