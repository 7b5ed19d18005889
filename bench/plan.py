""".venv/bin/python bench/plan.py

How long `clustertrain plan` takes, and how much memory, for the largest layouts issue 24 names, each in a fresh
process (start-up included): Llama-3-8B at 5,120 ranks (dp_replicate 20 × dp_shard 32 × tp 8) and Llama-3-70B at
1,024 ranks (dp_shard 128 × tp 8), both on Frontier's GCDs; the 8B one is the layout and batch of the Frontier
user's 640-node run (seeds/001: 21 sequences of 8,192 on each data-parallel rank, full checkpointing). Prints wall time, peak resident memory and the plan's
peak memory per rank and step time.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "Llama-3-8B, 5,120 ranks": ["configs/frontier-llama3-8b.yaml", "--nodes", "640", "--set", "parallel.tp=8",
                                "--set", "parallel.dp_replicate=20", "--set", "parallel.dp_shard=32",
                                "--set", "parallel.strategy=hybrid_zero3", "--set", "train.micro_batch_size=21",
                                "--set", "train.global_batch_size=13440"],  # seeds/001: 21 sequences a dp rank
    "Llama-3-70B, 1,024 ranks": ["bench/configs/llama3-70b-frontier.yaml", "--nodes", "128"],
}


def main() -> int:
    print(f"{'case':<28}{'wall':>8}{'peak RSS':>11}{'plan: peak/rank':>17}{'step':>9}")
    for name, args in CASES.items():
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "clustertrain", "plan", *args, "--json"], cwd=ROOT,
                                capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
        rss = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024 / 1024  # KiB -> GiB
        if result.returncode not in (0, 1):
            print(f"{name:<28} failed: {result.stderr.strip().splitlines()[-1]}")
            continue
        plan = json.loads(result.stdout)
        print(f"{name:<28}{wall:>7.1f}s{rss:>9.2f} GiB{plan['peak_bytes'] / 1e9:>14.1f} GB{plan['step_s']:>8.2f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
