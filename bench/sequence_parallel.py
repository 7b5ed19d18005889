""".venv/bin/python bench/sequence_parallel.py [--tp 4] [--hidden 512] [--layers 4] [--seq 2048] [--micro 2]

Sequence parallelism on and off at tp 4 on `--tp` gloo CPU ranks, measured against the plan: each mode's peak
resident memory per rank and step time, and `clustertrain plan`'s peak for the same run, side by side.

    .venv/bin/python bench/sequence_parallel.py
    .venv/bin/python bench/sequence_parallel.py --hidden 256 --layers 2 --seq 1024 --steps 2

The run: a Llama (default hidden 512, 4 layers, 8 heads, seq 2048, micro batch 2, vocab 4096, float32, random
tokens) whose activations dominate its weights and AdamW states, trained by `clustertrain train --nproc` with
`metrics.plan`: the run writes the plan made at its start and what it measured (the peak resident memory above
the process's before the model was built, the median step time) into its plan.json. One thread per rank;
compare the modes, not absolute figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def overrides(args: argparse.Namespace, sequence_parallel: bool, run_dir: Path) -> list[str]:
    model = (f"model.config={{hidden_size: {args.hidden}, intermediate_size: {args.hidden * 11 // 4}, "
             f"num_hidden_layers: {args.layers}, num_attention_heads: 8, num_key_value_heads: 8, "
             f"max_position_embeddings: {args.seq}}}")
    return ["model.arch=llama", model, "data.mode=random", f"data.seq_len={args.seq}", "data.vocab_size=4096",
            f"train.micro_batch_size={args.micro}", f"train.global_batch_size={args.micro}",
            f"train.steps={args.steps}", "train.eval_every=0", "train.sample_tokens=0", "checkpoint.every=0",
            "parallel.param_dtype=float32", f"parallel.tp={args.tp}",
            f"parallel.sequence_parallel={str(sequence_parallel).lower()}", "metrics.plan=true",
            "metrics.progress=lines", f"train.run_dir={run_dir}"]


def run(sets: list[str], tp: int, run_dir: Path) -> dict:
    """One mode trained on `tp` ranks: its plan.json (plan and measured)."""
    argv = [sys.executable, "-m", "clustertrain", "train", "--nproc", str(tp), *[f"--set={s}" for s in sets]]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT,
                          env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    if done.returncode:
        raise SystemExit(f"train failed: {done.stdout[-2000:]}{done.stderr[-3000:]}")
    return json.loads((run_dir / "plan.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for on in (False, True):
            run_dir = Path(tmp) / f"sp-{on}"
            rows["on" if on else "off"] = run(overrides(args, on, run_dir), args.tp, run_dir)
    print(f"tp {args.tp}, Llama hidden {args.hidden} × {args.layers} layers, {args.micro} × {args.seq} tokens a rank")
    print(f"{'sequence parallel':<18} {'resident GB':>11} {'plan GB':>8} {'plan/res':>8} {'step s':>7}")
    for mode, row in rows.items():
        plan, measured = row["plan"]["peak_bytes"], row["measured"]["peak_bytes"]
        print(f"{mode:<18} {measured / 1e9:>11.3f} {plan / 1e9:>8.3f} {plan / measured:>8.2f} "
              f"{row['measured']['step_s']:>7.2f}")
    off, on = rows["off"], rows["on"]
    print(f"on / off: resident {on['measured']['peak_bytes'] / off['measured']['peak_bytes']:.2f}, "
          f"plan {on['plan']['peak_bytes'] / off['plan']['peak_bytes']:.2f}")


if __name__ == "__main__":
    main()
