"""`clustertrain plan` against real runs on CPU ranks: the parameter, gradient and optimizer bytes of rank 0 are
the run's exactly, its peak memory within 10%; a layout that cannot work fails as the run does; the largest
models plan on this CPU in little memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import TINY, ONE_THREAD, run_cli

# big enough that tensors, not the interpreter, make the measured peak; glibc returns freed blocks of 64 KB and
# more to the system at once, so the resident peak follows the live tensors
MODEL = ["model.config={hidden_size: 384, intermediate_size: 1024, num_hidden_layers: 3, num_attention_heads: 6, "
         "num_key_value_heads: 2, max_position_embeddings: 256}", "data.seq_len=256", "data.vocab_size=2048",
         "train.steps=2", "train.sample_tokens=0", "metrics.plan=true"]
MMAP = {"MALLOC_MMAP_THRESHOLD_": "65536"}

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("nproc, layout", [(2, ["parallel.strategy=zero3"]),
                                           (4, ["parallel.strategy=zero2", "parallel.tp=2"])])
def test_the_plan_of_a_run_matches_what_it_measured(tmp_path, nproc, layout):
    args = [f"--set={o}" for o in (*TINY, *MODEL, *layout, f"train.run_dir={tmp_path}")]
    result = subprocess.run([sys.executable, "-m", "clustertrain", "train", "--nproc", str(nproc), *args],
                            capture_output=True, text=True, timeout=600, env={**os.environ, **ONE_THREAD, **MMAP})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plan vs measured: peak memory" in result.stdout
    saved = json.loads((tmp_path / "plan.json").read_text())
    planned, measured = saved["plan"]["stages"][0], saved["measured"]
    for key in ("params", "trainable", "grads", "optimizer"):
        assert planned[key] == measured[key], (key, planned[key], measured[key])
    assert abs(saved["plan"]["peak_bytes"] / measured["peak_bytes"] - 1) < 0.10, (saved["plan"]["peak_bytes"],
                                                                                  measured["peak_bytes"])


@pytest.mark.parametrize("override, key", [("parallel.tp=3", "parallel.tp"), ("parallel.pp=4", "parallel.pp"),
                                           ("train.global_batch_size=6", "train.global_batch_size")])
def test_a_layout_that_cannot_work_fails_with_the_runs_own_error(tmp_path, override, key):
    sets = [f"--set={o}" for o in (*TINY, override, f"train.run_dir={tmp_path}")]
    planned = run_cli("plan", "--world", "4", *sets)
    trained = run_cli("train", "--nproc", "4", *sets)
    assert planned.returncode == trained.returncode == 2, planned.stderr + trained.stderr
    assert key in planned.stderr and "Traceback" not in planned.stderr
    assert planned.stderr.strip().splitlines()[-1] in trained.stderr, (planned.stderr, trained.stderr)
