"""Start real clustertrain processes for tests: the CLI, with --nproc or under torchrun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clustertrain.train.metrics import read_jsonl

# A small model and corpus: fast on 2 cores, still a real Llama on real text.
TINY = [
    "model.config={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
    "num_key_value_heads: 2, max_position_embeddings: 256}",
    "data.vocab_size=512",
    "data.seq_len=64",
    "data.sources=[{format: stdlib, max_bytes: 400000}]",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "train.sample_tokens=0",
    "optim.warmup_steps=2",
    "metrics.log_every=1",
    "metrics.progress=lines",
    "data.num_workers=0",  # worker processes are tested in tests/unit/data; here they would only cost time
]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m clustertrain ARGS` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "clustertrain", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def train(run_dir: Path, *overrides: str, nproc: int | None = None, config: str | None = None,
          extra_args: tuple[str, ...] = (), expect: int = 0) -> subprocess.CompletedProcess:
    """Train the tiny model into `run_dir`; fails the test with the output unless the run exits `expect`."""
    args = ["train", *([config] if config else []), *(["--nproc", str(nproc)] if nproc else []), *extra_args]
    args += [f"--set={o}" for o in (*TINY, f"train.run_dir={run_dir}", *overrides)]
    result = run_cli(*args)
    assert result.returncode == expect, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def start(run_dir: Path, *overrides: str, nproc: int | None = 2, preexec_fn=None) -> subprocess.Popen:
    """Start training the tiny model in the background, in a session of its own (for signals and kills);
    `nproc=None` runs one rank without the `--nproc` launcher."""
    args = [f"--set={o}" for o in (*TINY, f"train.run_dir={run_dir}", *overrides)]
    return subprocess.Popen(
        [sys.executable, "-m", "clustertrain", "train", *(["--nproc", str(nproc)] if nproc else []), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=preexec_fn,
    )


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Poll until the run in `run_dir` has logged training step `step`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()}")
        if max(losses(run_dir), default=0) >= step if (run_dir / "metrics.jsonl").exists() else False:
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def wait_for_saves(run_dir: Path, proc: subprocess.Popen, count: int, timeout: float = 120) -> bool:
    """Poll until the `count`-th checkpoint write of this launch starts; True if it was caught mid-save."""
    deadline, seen = time.monotonic() + timeout, set()
    while time.monotonic() < deadline and proc.poll() is None:
        for tmp in (run_dir / "checkpoints").glob(".tmp-step-*") if (run_dir / "checkpoints").exists() else ():
            seen.add(tmp.name)
            if len(seen) >= count:
                return True
        time.sleep(0.002)
    return False


def children(pid: int) -> list[int]:
    """The process ids of `pid`'s children."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def losses(run_dir: Path) -> dict[int, float]:
    """step -> training loss from a run's metrics.jsonl (later records win, as after a resume)."""
    return {r["step"]: r["loss"] for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if r.get("loss") is not None}


def grad_norms(run_dir: Path) -> dict[int, float]:
    """step -> gradient norm from a run's metrics.jsonl."""
    return {r["step"]: r["grad_norm"] for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "grad_norm" in r}


class LayoutRuns(dict):
    """`runs[name]`: the run directory of layout `name` (dict(nproc, overrides)), trained once on first use."""

    def __init__(self, tmp_path_factory, layouts: dict[str, dict], *common: str):
        super().__init__()
        self.tmp_path_factory, self.layouts, self.common = tmp_path_factory, layouts, common

    def __missing__(self, name: str) -> Path:
        run_dir = self.tmp_path_factory.mktemp(name)
        result = train(run_dir, *self.common, *self.layouts[name]["overrides"], nproc=self.layouts[name]["nproc"])
        (run_dir / "stdout.log").write_text(result.stdout)
        self[name] = run_dir
        return run_dir


def final_weights(run_dir: Path, step: int) -> dict:
    """The model weights of a run's checkpoint at `step`, as one full state dict."""
    from clustertrain.checkpoint.export import load_checkpoint_model

    model, _, _ = load_checkpoint_model(Path(run_dir) / "checkpoints" / f"step-{step:07d}")
    return model.state_dict()


def require(tool: str, probe: list[str] | None = None) -> None:
    """Skip when `tool` is not usable here; fail instead under CI, where .ci/run must have installed it."""
    usable = shutil.which(tool) is not None
    if usable and probe:
        usable = subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    if usable:
        return
    message = f"{tool} is not usable here; `sudo bash scripts/slurm/setup_local_slurm.sh` installs and starts it"
    if os.environ.get("CI"):
        pytest.fail(message + " (.ci/run should have run it)")
    pytest.skip(message)


def free_port_env() -> str:
    """A free TCP port, as a string for MASTER_PORT."""
    from clustertrain.dist.spawn import free_port

    return str(free_port())
