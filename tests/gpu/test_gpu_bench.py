"""`bench/gpu.py --steps 5` at full size on the GPU: both workloads, every runner saying what it runs, the same work
on every row."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"
RUNNERS = ["clustertrain", "reference-full", "reference-chunked"]
ROW = re.compile(r"^(clustertrain|reference-full|reference-chunked)\s+([\d,]+)\s+([\d.]+)%\s+([\d.]+) GB$")
RAN = re.compile(r"^  (clustertrain|reference-full|reference-chunked): wrapper (.*)$")


def test_bench_runs_both_workloads_at_full_size():
    result = subprocess.run([sys.executable, str(BENCH), "--steps", "5", "--timeout", "240"], capture_output=True,
                            text=True, timeout=560)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    blocks = result.stdout.split("\n\n")
    for before_table, table, precision in zip(blocks[:2], blocks[1:], [
        "precision bf16 autocast, trainable weights fp32, loss",  # pretrain: fp32 master weights
        "precision bf16 autocast, trainable weights fp32, frozen bf16, loss",  # lora: a bf16 base
    ]):
        ran = {m[1]: m[2] for m in (RAN.match(line) for line in before_table.splitlines()) if m}
        assert list(ran) == RUNNERS, before_table
        for line in ran.values():
            assert line.startswith("none") and precision in line, line
            assert "clipping global norm 1," in line and "pinned, non_blocking copy" in line, line
        assert re.search(r"loss (chunked|fused)", ran["clustertrain"]), ran["clustertrain"]  # a 128k vocabulary
        assert "bfloat16 on cuda" in table.splitlines()[0], table
        rows = {m[1]: m for m in (ROW.match(line) for line in table.splitlines()) if m}
        assert list(rows) == RUNNERS, table
        for match in rows.values():
            assert float(match[2].replace(",", "")) > 0 and float(match[3]) > 0 and float(match[4]) > 0, table
