""".venv/bin/python bench/parallel.py

Parallel layouts side by side: tokens/s and the peak memory of a rank for each, on the same model and batch.

    .venv/bin/python bench/parallel.py
    .venv/bin/python bench/parallel.py --rounds 3 --steps 16 --out bench/out/parallel.png
    .venv/bin/python bench/parallel.py --layouts "1 rank,zero3 x2,tp2" --with-4 --keep
    .venv/bin/python bench/parallel.py --hidden 512 --layers 8 --set parallel.param_dtype=bfloat16

Every layout is a fresh `clustertrain train --nproc N` in its own run directory under a temp folder (removed
at the end unless `--keep`), on the same Llama (default hidden 256, 4 layers, 8 heads of 32, seq_len 256) and
the same global batch of 8 sequences (micro batch 4), from the same seed, so every layout sees the same data
and should end on the same loss. The data is the tests' tiny corpus (the standard library's sources, a BPE of
512 tokens trained locally and cached), so no network is needed. Layouts, by name for `--layouts`:

    1 rank              ddp, --nproc 1 (the baseline of the "vs 1 rank" column)
    ddp x2              parallel.strategy=ddp, --nproc 2
    zero2 x2            parallel.strategy=zero2, --nproc 2
    zero3 x2            parallel.strategy=zero3, --nproc 2
    tp2                 parallel.tp=2, --nproc 2 (one data-parallel rank)
    zero3 + full AC x2  parallel.strategy=zero3 parallel.activation_checkpoint=full, --nproc 2
    pp2                 parallel.pp=2, --nproc 2 (1f1b, 2 microbatches of 4 rows: the others' microbatch size)
    zero3 x4            parallel.strategy=zero3, --nproc 4 (with --with-4)
    zero3 dp2 x tp2     parallel.strategy=zero3 parallel.tp=2, --nproc 4 (with --with-4)

Rounds are interleaved (A, B, C, A, B, C, ...) so that a noisy, shared machine slows every layout alike; each
number is the median over rounds. Per run: tokens/s is the median of the logged steps' rates (every step is
logged) after the first 2 (warm-up); tokens/s per rank is that divided by the world size; peak memory is the
largest `mem_gb` rank 0 logged (the process's peak RSS on CPU, the GPU allocator peak on a GPU); the loss is
the last step's. A layout that fails is shown as "failed" with the end of its stderr, and is not run again in
later rounds; the others go on.

Threads: each rank gets OMP_NUM_THREADS = cores // ranks (at least 1), so one rank uses every core and the
layouts compare the same machine; `--threads N` sets N per rank for every layout instead. With more ranks than
cores (4-rank layouts on 2 cores) ranks share cores and the table says so. On a busy machine a rank of several
threads slows down far more than a rank of one (1 rank on a shared 2-core box: about 4x slower with 2 threads than
with 1), which flatters the multi-rank layouts: the benchmark warns when the load is high; compare with --threads 1.

Output: the table on stdout, a PNG of two bar charts (tokens/s, peak memory of rank 0) at `--out`, and the raw
numbers of every run as JSON beside it (same name, .json). The PNG needs matplotlib (in the dev extra, which
`make install` installs); without it only the JSON is written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

DESCRIPTION = "tokens/s and peak memory per rank of each parallel layout (ddp, zero2/3, tp, AC, pp) on one model"
# The data of tests/helpers.py's TINY: the stdlib corpus and a small locally trained vocabulary, no network.
DATA = ["data.vocab_size=512", "data.sources=[{format: stdlib, max_bytes: 400000}]", "data.num_workers=0"]
GLOBAL_BATCH = 8
MICRO_BATCH = 4
WARMUP_LOGS = 2  # logged steps left out of tokens/s: the first steps allocate and warm caches
NOT_AVAILABLE = re.compile(r"pipeline parallel\w* is not available", re.IGNORECASE)


@dataclass(frozen=True)
class Layout:
    name: str
    nproc: int
    overrides: tuple[str, ...]


LAYOUTS = (
    Layout("1 rank", 1, ("parallel.strategy=ddp",)),
    Layout("ddp x2", 2, ("parallel.strategy=ddp",)),
    Layout("zero2 x2", 2, ("parallel.strategy=zero2",)),
    Layout("zero3 x2", 2, ("parallel.strategy=zero3",)),
    Layout("tp2", 2, ("parallel.tp=2",)),
    Layout("zero3 + full AC x2", 2, ("parallel.strategy=zero3", "parallel.activation_checkpoint=full")),
    Layout("pp2", 2, ("parallel.pp=2",)),
)
LAYOUTS_4 = (
    Layout("zero3 x4", 4, ("parallel.strategy=zero3",)),
    Layout("zero3 dp2 x tp2", 4, ("parallel.strategy=zero3", "parallel.tp=2")),
)
BASELINE = "1 rank"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--layouts", default=None,
                   help="comma-separated layout names to run, in this order (default: every 1- and 2-rank layout); "
                        f"known: {', '.join(l.name for l in LAYOUTS + LAYOUTS_4)}")
    p.add_argument("--with-4", action="store_true", help="add the 4-rank layouts to the default set")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs per layout, interleaved; the median is reported (default 2)")
    p.add_argument("--steps", type=int, default=16, help=f"optimizer steps per run; the first {WARMUP_LOGS} are "
                                                          "not timed (default 16)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size; heads of 32 (default 256: 8 heads)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per rank (default: cores // ranks)")
    p.add_argument("--timeout", type=float, default=600, help="seconds before a run counts as failed (default 600)")
    p.add_argument("--out", type=Path, default=Path("bench/out/parallel.png"),
                   help="the PNG; the JSON goes beside it (default bench/out/parallel.png)")
    p.add_argument("--keep", action="store_true", help="leave the runs' temp folder in place")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every layout, as `clustertrain train --set` (repeatable); "
                        "the layout's own overrides come after it")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.steps <= WARMUP_LOGS:
        p.error(f"--steps must be > {WARMUP_LOGS}: the first {WARMUP_LOGS} logged steps are warm-up")
    if args.hidden % 64:
        p.error("--hidden must be a multiple of 64 (heads of 32, an even head count for tp=2)")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    known = {l.name: l for l in LAYOUTS + LAYOUTS_4}
    if args.layouts is None:
        args.layouts = list(LAYOUTS + (LAYOUTS_4 if args.with_4 else ()))
    else:
        names = [n.strip() for n in args.layouts.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            p.error(f"unknown layout(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
        args.layouts = [known[n] for n in names]
    return args


def model_overrides(args: argparse.Namespace) -> list[str]:
    """The benchmark's model, batch and quiet-run settings, the same for every layout."""
    heads = args.hidden // 32
    intermediate = -(-args.hidden * 8 // 3 // 16) * 16  # Llama's 8/3 x hidden, rounded up to a multiple of 16
    return [
        f"model.config={{hidden_size: {args.hidden}, intermediate_size: {intermediate}, "
        f"num_hidden_layers: {args.layers}, num_attention_heads: {heads}, num_key_value_heads: {heads}, "
        f"max_position_embeddings: {args.seq_len}}}",
        *DATA,
        f"data.seq_len={args.seq_len}",
        f"train.global_batch_size={GLOBAL_BATCH}",
        f"train.micro_batch_size={MICRO_BATCH}",
        f"train.steps={args.steps}",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.resume=none",
        "optim.warmup_steps=2",
        "checkpoint.every=0",
        "metrics.log_every=1",
        "metrics.progress=none",
        "metrics.tensorboard=false",
    ]


def describe_model(base: list[str]) -> str:
    """One line on the model: its size (from clustertrain's own accounting, on the meta device) and the batch.

    Loading the tokenizer here also trains and caches it once, before any timed run needs it.
    """
    from clustertrain.data.tokenize import load_tokenizer
    from clustertrain.model.build import build_hf_config, build_meta_model
    from clustertrain.model.estimate import count_params
    from clustertrain.resolve.load import load_checked_config

    cfg = load_checked_config(None, base)
    hf = build_hf_config(cfg.model, load_tokenizer(cfg.data), cfg.data.vocab_size)
    params = count_params(build_meta_model(hf))["total"]
    return (f"model: {cfg.model.arch} hidden {hf.hidden_size} x {hf.num_hidden_layers} layers, "
            f"{hf.num_attention_heads} heads, vocab {hf.vocab_size}: {params / 1e6:.2f}M parameters; "
            f"batch {cfg.train.global_batch_size} x {cfg.data.seq_len} = "
            f"{cfg.tokens_per_step} tokens/step (micro {cfg.train.micro_batch_size})")


def threads_for(layout: Layout, args: argparse.Namespace, cores: int) -> int:
    return args.threads or max(1, cores // layout.nproc)


def run_layout(layout: Layout, run_dir: Path, base: list[str], threads: int, timeout: float) -> dict:
    """One `clustertrain train --nproc N` of `layout`; returns its numbers, or its status and stderr tail."""
    overrides = [*base, f"train.run_dir={run_dir}", *layout.overrides]
    command = [sys.executable, "-m", "clustertrain", "train", "--nproc", str(layout.nproc),
               *[f"--set={o}" for o in overrides]]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    start = time.perf_counter()
    # A session of its own, so a run that hangs can be stopped with all its ranks.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
        stderr += f"\n(stopped after {timeout:.0f} s)"
    wall_s = time.perf_counter() - start
    if proc.returncode == 2 and NOT_AVAILABLE.search(stderr):
        return {"status": "n/a", "wall_s": wall_s, "message": stderr.strip().splitlines()[-1]}
    if proc.returncode:
        return {"status": "failed", "wall_s": wall_s, "exit_code": proc.returncode, "stderr_tail": stderr[-3000:]}
    from clustertrain.train.metrics import read_metrics

    steps = sorted((r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("tokens_per_s") is not None),
                   key=lambda r: r["step"])
    timed = steps[WARMUP_LOGS:]
    return {
        "status": "ok",
        "wall_s": wall_s,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "tokens_per_s_per_rank": statistics.median(r["tokens_per_s_per_rank"] for r in timed),
        "mem_gb": max(r["mem_gb"] for r in steps if r.get("mem_gb") is not None),
        "load_mem_gb": next((r["load_mem_gb"] for r in read_metrics(run_dir / "metrics.jsonl") if "load_mem_gb" in r),
                            None),
        "last_loss": steps[-1]["loss"],
        "last_step": steps[-1]["step"],
        "timed_steps": len(timed),
    }


def summarize(runs: list[dict]) -> dict:
    """The median of each number over a layout's rounds, or the status of the round that stopped it."""
    ok = [r for r in runs if r["status"] == "ok"]
    if len(ok) < len(runs) or not ok:
        return {k: v for k, v in runs[-1].items() if k not in ("wall_s",)}
    keys = ("tokens_per_s", "tokens_per_s_per_rank", "mem_gb", "load_mem_gb", "last_loss")
    return {"status": "ok", **{k: statistics.median(r[k] for r in ok if r[k] is not None) for k in keys}}


def status_text(summary: dict) -> str:
    if summary["status"] == "n/a":
        return "n/a (not available)"
    return f"failed (exit {summary['exit_code']})"


def print_table(layouts: list[Layout], summaries: dict[str, dict], threads: dict[str, int], cores: int) -> None:
    base = summaries.get(BASELINE, {})
    base_rate = base.get("tokens_per_s") if base.get("status") == "ok" else None
    width = max(len("layout"), *(len(l.name) for l in layouts))
    header = (f"{'layout':<{width}}  {'ranks':>5}  {'thr/rank':>8}  {'tokens/s':>9}  {'tok/s/rank':>10}  "
              f"{'peak mem GB, rank 0':>19}  {'vs 1 rank':>9}  {'last loss':>9}")
    print(header)
    print("-" * len(header))
    for layout in layouts:
        s = summaries[layout.name]
        lead = f"{layout.name:<{width}}  {layout.nproc:>5}  {threads[layout.name]:>8}  "
        if s["status"] != "ok":
            print(lead + status_text(s))
            continue
        ratio = f"{s['tokens_per_s'] / base_rate:.2f}" if base_rate else "-"
        print(lead + f"{s['tokens_per_s']:>9,.0f}  {s['tokens_per_s_per_rank']:>10,.0f}  {s['mem_gb']:>19.3f}  "
                     f"{ratio:>9}  {s['last_loss']:>9.4f}")
    print("-" * len(header))
    crowded = [l.name for l in layouts if l.nproc * threads[l.name] > cores]
    if crowded:
        print(f"note: ranks x threads exceed the {cores} cores for {', '.join(crowded)}: their ranks share cores")
    losses = {round(s["last_loss"], 4) for s in summaries.values() if s["status"] == "ok"}
    if len(losses) > 1:
        print("note: the last losses differ between layouts; a few 1e-4 come from summation order, more is a bug")


def plot(path: Path, layouts: list[Layout], summaries: dict[str, dict], title: str) -> bool:
    """Two bar charts side by side, tokens/s and rank 0's peak memory, one bar per layout; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [l.name for l in layouts]
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 1.2 * len(names) + 4), 5), constrained_layout=True)
    panels = ((axes[0], "tokens_per_s", "tokens/s (all ranks)", "{:,.0f}"),
              (axes[1], "mem_gb", "peak memory per rank, GB (rank 0)", "{:.2f}"))
    for ax, key, label, fmt in panels:
        values = [summaries[n].get(key) or 0 for n in names]
        bars = ax.bar(range(len(names)), values, color=[f"C{i}" for i in range(len(names))])
        top = max(values, default=0) or 1
        for bar, name, value in zip(bars, names, values):
            s = summaries[name]
            text = fmt.format(value) if s["status"] == "ok" else status_text(s).split(" ")[0]
            ax.text(bar.get_x() + bar.get_width() / 2, value + top * 0.01, text, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=25, ha="right")
        ax.set_ylabel(label)
        ax.set_ylim(0, top * 1.12)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    base = [*model_overrides(args), *args.overrides]
    model_line = describe_model(base)
    threads = {l.name: threads_for(l, args, cores) for l in args.layouts}
    print(model_line)
    print(f"{len(args.layouts)} layouts x {args.rounds} rounds of {args.steps} steps (tokens/s from the steps after "
          f"the first {WARMUP_LOGS}), interleaved; {cores} cores; medians over rounds")
    load = os.getloadavg()[0]
    if load > cores / 2 and any(t > 1 for t in threads.values()):
        # OpenMP threads of one rank wait for each other, so a busy core stalls all of them: seen here as 1 rank
        # with 2 threads running at a quarter of its 1-thread speed on a shared 2-core machine.
        print(f"note: the machine is busy (load {load:.1f} on {cores} cores); ranks of several threads suffer most "
              "from it: compare with --threads 1")
    tmp = Path(tempfile.mkdtemp(prefix="clustertrain-bench-parallel-"))
    runs: dict[str, list[dict]] = {l.name: [] for l in args.layouts}
    total, done = len(args.layouts) * args.rounds, 0
    try:
        for round_index in range(1, args.rounds + 1):
            for layout in args.layouts:
                done += 1
                previous = runs[layout.name]
                if previous and previous[-1]["status"] != "ok":
                    print(f"[{done}/{total}] {layout.name} round {round_index} ... skipped "
                          f"({status_text(previous[-1])} in an earlier round)", flush=True)
                    continue
                print(f"[{done}/{total}] {layout.name} round {round_index} ...", end="", flush=True)
                run_dir = tmp / f"{re.sub(r'[^a-z0-9]+', '-', layout.name)}-{round_index}"
                result = run_layout(layout, run_dir, base, threads[layout.name], args.timeout)
                previous.append(result)
                if result["status"] == "ok":
                    print(f" {result['wall_s']:.1f} s, {result['tokens_per_s']:,.0f} tokens/s", flush=True)
                elif result["status"] == "n/a":
                    print(f" n/a: {result['message']}", flush=True)
                else:
                    tail = "\n".join("    " + line for line in result["stderr_tail"].strip().splitlines()[-15:])
                    print(f" failed (exit {result['exit_code']}) after {result['wall_s']:.1f} s; end of stderr:\n"
                          f"{tail}", flush=True)
    finally:
        if args.keep:
            print(f"runs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    summaries = {name: summarize(r) for name, r in runs.items()}
    print()
    print(model_line)
    print_table(args.layouts, summaries, threads, cores)

    out_json = args.out.with_suffix(".json")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps({
        "model": model_line, "steps": args.steps, "rounds": args.rounds, "warmup_logs": WARMUP_LOGS,
        "cores": cores, "overrides": base,
        "layouts": [{"name": l.name, "nproc": l.nproc, "overrides": list(l.overrides), "threads": threads[l.name],
                     "summary": summaries[l.name], "runs": runs[l.name]} for l in args.layouts],
    }, indent=2) + "\n")
    title = (f"{model_line}\n{args.steps} steps x {args.rounds} rounds (medians), {cores} cores, "
             f"threads per rank: {args.threads or 'cores // ranks'}")
    if plot(args.out, args.layouts, summaries, title):
        print(f"plot: {args.out}; numbers: {out_json}")
    else:
        print(f"numbers: {out_json}; no plot: matplotlib is not installed here (`pip install matplotlib`)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
