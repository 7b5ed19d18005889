""".venv/bin/python bench/checkpointing.py

Activation checkpointing none / every_n / selective / full on one CPU rank, measured against the plan: each
mode's peak resident memory and step time, and `clustertrain plan`'s peak for the same run, side by side.

    .venv/bin/python bench/checkpointing.py
    .venv/bin/python bench/checkpointing.py --hidden 256 --layers 4 --seq 512 --steps 2 --modes none,selective

The run: a Llama (default hidden 512, 8 layers, 8 heads, seq 1024, micro batch 4, vocab 4096, float32) whose
activations dominate its weights and AdamW states; built as training builds it (`build_model`), checkpointed
by `apply_activation_checkpointing`, stepped with the training loss and AdamW. Each mode runs in a fresh process
(peak RSS is per process): "resident" is its peak RSS above the process's own RSS before the model was built
(torch's libraries), the closest the OS gives to what the plan counts. Step time is the median of the steps after
the first. Threads: `--threads` (default 1: on a shared machine a rank of several threads slows down far more,
and unevenly, than a rank of one); compare the modes, not absolute figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def overrides(args: argparse.Namespace, mode: str) -> list[str]:
    model = (f"model.config={{hidden_size: {args.hidden}, intermediate_size: {args.hidden * 11 // 4}, "
             f"num_hidden_layers: {args.layers}, num_attention_heads: 8, num_key_value_heads: 8, "
             f"max_position_embeddings: {args.seq}}}")
    return ["model.arch=llama", model, f"data.seq_len={args.seq}", "data.vocab_size=4096",
            f"train.micro_batch_size={args.micro}", f"train.global_batch_size={args.micro}",
            "parallel.param_dtype=float32", f"parallel.activation_checkpoint={mode}"]


def measure(sets: list[str], steps: int, threads: int) -> dict:
    """One mode's peak RSS above the baseline and its step times, in this process."""
    import torch

    torch.set_num_threads(threads)
    from clustertrain.model.build import block_classes, build_model
    from clustertrain.model.loss import token_loss_sum
    from clustertrain.parallel.ac import apply_activation_checkpointing
    from clustertrain.resolve.load import load_checked_config

    config = load_checked_config(None, sets)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    built = build_model(config.model, None, None, config.data.vocab_size, param_dtype=torch.float32,
                        device="cpu", loss=config.train.loss, loss_chunk_tokens=config.train.loss_chunk_tokens)
    model = built.model.to_empty(device="cpu")
    torch.manual_seed(0)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02)
    apply_activation_checkpointing(model, config.parallel.activation_checkpoint,
                                   config.parallel.activation_checkpoint_every, block_classes(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.data.vocab_size, (config.train.micro_batch_size, config.data.seq_len))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        token_loss_sum(model, tokens, tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes
    return {"resident": peak - base, "step_s": statistics.median(times[1:] or times)}


def planned(sets: list[str]) -> int:
    cli = "import sys; from clustertrain.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", cli, "plan", "--world", "1", "--json", *[f"--set={s}" for s in sets]],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"plan failed: {out.stderr.strip()}")
    return json.loads(out.stdout)["peak_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", default="none,every_n,selective,full")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a worker: measure this JSON list of overrides
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(json.loads(args.one), args.steps, args.threads)))
        return
    rows = {}
    for mode in args.modes.split(","):
        sets = overrides(args, mode)
        worker = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--threads", str(args.threads),
                                 "--one", json.dumps(sets)], capture_output=True, text=True)
        if worker.returncode:
            raise SystemExit(f"{mode} failed: {worker.stderr.strip()[-2000:]}")
        rows[mode] = {**json.loads(worker.stdout.splitlines()[-1]), "plan": planned(sets)}
    none = rows.get("none")
    print(f"{'mode':<10} {'resident GB':>11} {'plan GB':>8} {'plan/res':>8} {'step s':>7} {'vs none':>8}")
    for mode, row in rows.items():
        ratio = row["plan"] / row["resident"]
        slower = f"{row['step_s'] / none['step_s']:.2f}x" if none else "-"
        print(f"{mode:<10} {row['resident'] / 1e9:>11.2f} {row['plan'] / 1e9:>8.2f} {ratio:>8.2f} "
              f"{row['step_s']:>7.2f} {slower:>8}")


if __name__ == "__main__":
    main()
