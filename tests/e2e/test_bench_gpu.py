"""bench/gpu.py: --tiny runs every runner of both workloads on CPU, each saying what it runs, the same work on
every row, with clustertrain's plan beside its measurement; the full shapes refuse to start without a GPU; a
runner past --timeout is killed."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"
RUNNERS = ["clustertrain", "reference-full", "reference-chunked"]
ROW = re.compile(r"^(clustertrain|reference-full|reference-chunked)\s+([\d,]+)\s+([\d.]+)%\s+([\d.]+) GB$")
RAN = re.compile(r"^  (clustertrain|reference-full|reference-chunked): (wrapper .*)$")
NUMBER = r"([\d.,]+(?:e[+-]\d+)?)"
PLAN = re.compile(rf"^plan vs measured \(clustertrain\): peak memory {NUMBER} GB vs {NUMBER} GB \([\d.]+\), "
                  rf"step time {NUMBER} s vs {NUMBER} s \([\d.]+\), tokens/s {NUMBER} vs {NUMBER} "
                  r"\(CPU: measured is the process's peak RSS, which includes ~0\.5 GB of libraries\)$")


def bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=timeout)


def what_ran(line: str) -> dict[str, str]:
    """A `ran:` line's parts, e.g. {"wrapper": "none (one process)", "loss": "full (...)", ...}."""
    parts = {}
    for part in re.split(r", (?=(?:wrapper|precision|loss|kernels|attention|compile|clipping|optimizer|data) )",
                         line):
        key, _, value = part.partition(" ")
        parts[key] = value
    return parts


@pytest.mark.dist  # trains: not in `make test-fast`
def test_tiny_bench_says_what_each_runner_runs_and_prints_three_rows_for_both_workloads():
    result = bench("--tiny", "--steps", "3", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    blocks = result.stdout.split("\n\n")  # [ran lines of workload 1], [table 1 + ran lines of 2], [table 2]
    tables = blocks[1:]
    assert [t.splitlines()[0].split(":")[0] for t in tables] == [
        "pretraining, Llama-3.2-1B shape (tiny)", "LoRA, Llama-3.2-3B shape (tiny)"
    ], result.stdout
    for before_table in blocks[:2]:  # each runner said what it runs before its workload's table
        ran = {m[1]: what_ran(m[2]) for m in (RAN.match(line) for line in before_table.splitlines()) if m}
        assert list(ran) == RUNNERS, before_table
        for parts in ran.values():  # the same work on every row
            assert parts["wrapper"].startswith("none"), parts
            assert parts["clipping"] == "global norm 1" and parts["optimizer"] == "AdamW fused", parts
            assert parts["attention"] == "sdpa" and parts["compile"] == "off", parts
            assert "host batch each step" in parts["data"], parts
        assert len({parts["precision"] for parts in ran.values()}) == 1, ran
        assert ran["clustertrain"]["loss"] == "full"  # a 512-token vocabulary: train.loss auto is full
        assert ran["reference-full"]["loss"].startswith("full (fp32 logits")
        assert ran["reference-chunked"]["loss"].startswith("chunked (4096 tokens")
    for table in tables:
        rows = {m[1]: m for m in (ROW.match(line) for line in table.splitlines()) if m}
        assert list(rows) == RUNNERS, table
        for match in rows.values():
            tokens_per_s, mfu, mem_gb = float(match[2].replace(",", "")), float(match[3]), float(match[4])
            assert tokens_per_s > 0 and mfu > 0 and mem_gb > 0, table
        for reference in RUNNERS[1:]:
            assert re.search(rf"ratio clustertrain/{reference}: tokens/s \d+\.\d\d, peak memory \d+\.\d\d", table), \
                table
        plans = [m for m in (PLAN.match(line) for line in table.splitlines()) if m]  # the plan beside the run
        assert len(plans) == 1, table
        assert all(float(n.replace(",", "")) > 0 for n in plans[0].groups()), plans[0][0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the full shapes would run")
def test_full_shapes_without_a_gpu_are_one_line_and_exit_2():
    result = bench("--steps", "2", timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout == ""
    assert result.stderr == ("bench/gpu.py: the full shapes need a GPU and torch sees none; --tiny runs the same "
                             "code on this CPU in seconds\n")


def test_a_runner_past_its_timeout_is_killed_and_its_row_reads_failed():
    marker = f"train.seed={random.randrange(10**6, 10**7)}"  # finds this test's runner processes in /proc
    result = bench("--tiny", "--workload", "pretrain", "--steps", "2", "--timeout", "1", "--set", marker,
                   timeout=120)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.count("ran past --timeout 1 s and was killed") == 3, result.stderr[-3000:]
    assert [line.split()[:2] for line in result.stdout.splitlines() if line.endswith("failed")] == [
        [runner, "failed"] for runner in RUNNERS], result.stdout
    left = [p for p in Path("/proc").glob("[0-9]*/cmdline") if marker in _read(p)]
    assert left == [], "a runner outlived its timeout"


def _read(path: Path) -> str:
    try:
        return path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
