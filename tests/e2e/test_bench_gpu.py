"""bench/gpu.py --tiny: both workloads, both runners, on CPU, with numbers in the table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"
ROW = re.compile(r"^(clustertrain|reference)\s+([\d,]+)\s+([\d.]+)%\s+([\d.]+) GB$")


@pytest.mark.dist  # trains: not in `make test-fast`
def test_tiny_bench_prints_both_runners_for_both_workloads():
    result = subprocess.run([sys.executable, str(BENCH), "--tiny", "--steps", "3"], capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    tables = result.stdout.split("\n\n")[1:]
    assert [t.splitlines()[0].split(":")[0] for t in tables] == [
        "pretraining, Llama-3.2-1B shape (tiny)", "LoRA, Llama-3.2-3B shape (tiny)"
    ], result.stdout
    for table in tables:
        rows = {m[1]: m for m in (ROW.match(line) for line in table.splitlines()) if m}
        assert set(rows) == {"clustertrain", "reference"}, table
        for match in rows.values():
            tokens_per_s, mfu, mem_gb = float(match[2].replace(",", "")), float(match[3]), float(match[4])
            assert tokens_per_s > 0 and mfu > 0 and mem_gb > 0, table
        assert re.search(r"ratio clustertrain/reference: tokens/s \d+\.\d\d, peak memory \d+\.\d\d", table), table
