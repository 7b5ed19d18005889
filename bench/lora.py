""".venv/bin/python bench/lora.py

LoRA against full fine-tuning of the same model: tokens/s and the peak memory of the rank.

    .venv/bin/python bench/lora.py --rounds 3 --steps 40 --rank 16
    .venv/bin/python bench/lora.py --set parallel.param_dtype=bfloat16 --set parallel.device=cuda

A Llama of hidden 384 / 6 layers (about 14M parameters) is saved once with `save_pretrained`, then fine-tuned
from that snapshot by `clustertrain train` in fresh processes (one rank), alternating full and LoRA runs for
`--rounds` rounds so that machine noise hits both. Tokens/s is the median of each run's logged rates after
its first log step; memory is the run's peak (GPU allocator peak, or peak RSS on CPU), and `load` is the peak
once the weights were in place, before any training step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from clustertrain.data.tokenize import load_tokenizer
from clustertrain.resolve.load import load_checked_config

DATA = ["data.sources=[{format: stdlib, max_bytes: 2000000}]", "data.vocab_size=4096", "data.seq_len=128"]


def snapshot(out: Path) -> int:
    """Save the benchmark model with the locally trained tokenizer; returns its parameter count."""
    tokenizer = load_tokenizer(load_checked_config(None, DATA).data)
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=384, intermediate_size=1024,
                                  num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=6,
                                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def run(run_dir: Path, model_dir: Path, steps: int, extra: list[str]) -> dict[str, float]:
    overrides = [*DATA, f"model.path={model_dir}", "model.config={}", f"train.steps={steps}",
                 "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=0",
                 "train.sample_tokens=0", "checkpoint.every=0", "metrics.log_every=5", "metrics.progress=none",
                 f"train.run_dir={run_dir}", "train.resume=none", *extra]
    result = subprocess.run([sys.executable, "-m", "clustertrain", "train", *[f"--set={o}" for o in overrides]],
                            capture_output=True, text=True)
    if result.returncode:
        sys.exit(result.stderr[-3000:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if r.get("tokens_per_s") and r["step"] > 5]
    return {"tokens_per_s": statistics.median(rates), "mem_gb": max(r.get("mem_gb") or 0 for r in records),
            "load_gb": next(r["load_mem_gb"] for r in records if "load_mem_gb" in r)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        params = snapshot(tmp / "model")
        modes = {"full": [], "lora": [f"lora.rank={args.rank}", f"lora.alpha={2 * args.rank}"]}
        results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        for i in range(args.rounds):
            for mode in (list(modes) if i % 2 == 0 else list(modes)[::-1]):
                results[mode].append(run(tmp / f"{mode}-{i}", tmp / "model", args.steps, modes[mode] + args.set))
    print(f"model: llama 384x6, {params / 1e6:.1f}M parameters ({params * 4 / 1e9:.2f} GB fp32); "
          f"{args.rounds} rounds x {args.steps} steps of 8 x 128 tokens, 1 rank")
    print(f"{'mode':6} {'tokens/s':>10} {'peak GB':>8} {'load GB':>8}")
    summary = {}
    for mode, runs in results.items():
        summary[mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        s = summary[mode]
        print(f"{mode:6} {s['tokens_per_s']:10,.0f} {s['mem_gb']:8.2f} {s['load_gb']:8.2f}")
    lora, full = summary["lora"], summary["full"]
    print(f"lora / full: tokens/s {lora['tokens_per_s'] / full['tokens_per_s']:.2f}, "
          f"peak memory {lora['mem_gb'] / full['mem_gb']:.2f}")


if __name__ == "__main__":
    main()
