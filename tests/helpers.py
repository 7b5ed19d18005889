"""Start real clustertrain processes for tests: the CLI, with --nproc or under torchrun; and check how they end."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from forkserver import SERVER, Forked

from clustertrain.run_dir import RunDir
from clustertrain.train.metrics import read_metrics
from clustertrain.train.status import read_status

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
    "train.sample_tokens=4",  # the end-of-run sample, as users get it: short, but through every layout's forward
    "optim.warmup_steps=2",
    "metrics.log_every=1",
    "metrics.progress=lines",
    "data.num_workers=0",  # worker processes are tested in tests/unit/data; here they would only cost time
    "metrics.plan=false",  # planned in tests/distributed/test_plan.py; elsewhere it would only cost time
]


# Every test process runs on one intra-op thread (conftest.py sets the same for the test process itself): the
# tiny model gains nothing from more, and threads that spin for cores other tests hold make a run 5x slower.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# The `--nproc` launcher picks a free port for its ranks' store and releases it; another test can take it before
# rank 0 binds it. Such a run fails at its start, before it writes anything, and is started again.
PORT_TAKEN = "EADDRINUSE"
STARTED: list[subprocess.Popen] = []  # by start(); conftest.py kills what a test leaves running


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `python -m clustertrain ARGS` (in `cwd`) and capture its output. Past `timeout` seconds, the command and
    every process it started (its `--nproc` ranks and their workers) are killed and the test fails with the output."""
    for _ in range(3):
        result = _run_once(["-m", "clustertrain", *args], env, timeout, cwd)
        if result.returncode == 0 or PORT_TAKEN not in result.stderr:
            break
    return result


def popen(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None, fresh: bool = False,
          preexec_fn=None) -> subprocess.Popen | Forked:
    """Start `python ARGV` in a session of its own, its output piped. `python -m clustertrain ...` is forked from
    the fork server (tests/forkserver.py), which has imported torch and transformers already, unless `fresh` asks
    for a new interpreter (what the test checks happens while torch imports) or a fork could not behave like one."""
    env = {**os.environ, **ONE_THREAD, **(env or {})}
    if argv[:2] == ["-m", "clustertrain"] and not fresh and preexec_fn is None and SERVER.can_fork(argv[2:], env):
        return SERVER.popen(argv[2:], env, cwd)
    return subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True, cwd=cwd,
                            preexec_fn=preexec_fn)


def _run_once(argv: list[str], env: dict[str, str] | None, timeout: float, cwd: Path | None,
              ) -> subprocess.CompletedProcess:
    proc = popen(argv, env, cwd)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"`clustertrain {' '.join(argv[2:])[:300]}` ran past {timeout} s: killed it and every "
                             f"process it started\n{stdout[-3000:]}\n{stderr[-5000:]}") from None
    except BaseException:  # Ctrl-C, pytest-timeout: leave nothing running
        kill_tree(proc.pid)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def train(run_dir: Path, *overrides: str, nproc: int | None = None, config: str | None = None,
          extra_args: tuple[str, ...] = (), expect: int = 0, state: str | None = None,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Train the tiny model into `run_dir`; fails the test with the output unless the run exits `expect` and its
    status.json says so (see `check_ending`)."""
    args = ["train", *([config] if config else []), *(["--nproc", str(nproc)] if nproc else []), *extra_args]
    args += [f"--set={o}" for o in (*TINY, f"train.run_dir={run_dir}", *overrides)]
    before = read_status(RunDir(run_dir))
    result = run_cli(*args, env=env)
    check_ending(Path(run_dir), result, expect, state=state, before=before)
    return result


# The state status.json holds after each exit code; exit 0 and exit 2 are worked out in check_ending.
STATE_AFTER_EXIT = {1: "failed", 3: "failed", 74: "failed", 75: "preempted", 76: "hung"}


def check_ending(run_dir: Path, result: subprocess.CompletedProcess, expect: int = 0, state: str | None = None,
                 before: dict | None = None) -> None:
    """Assert that a run ended as its user would see it: exit code `expect` and status.json in the matching state.

    Exit 0: "finished" at the last step, with the end-of-run sample printed (unless the config turns it off, the
    run is pipelined or has no tokenizer), or "stopped" when train.stop_after_steps ended it earlier. Exit 2, a
    user error: status.json as it was `before` (a refused start touches nothing), unless `state` names the state
    (an error after the start: "failed"). Exit 1, 3 (diverged) and 74 (a failed save): "failed"; 75: "preempted";
    76 (the watchdog ended a hang): "hung".
    """
    output = f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert result.returncode == expect, output
    status = read_status(RunDir(run_dir))
    if expect == 2 and state is None:
        assert status == before, f"a refused start changed status.json: {before} -> {status}\n{output}"
        return
    assert status is not None, f"no status.json in {run_dir}\n{output}"
    if expect != 0:
        want = state or STATE_AFTER_EXIT.get(expect, "failed")
        assert status["state"] == want, f"status.json {status}; expected {want!r}\n{output}"
        return
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    early = config["train"]["stop_after_steps"] is not None and status["step"] < status["total_steps"]
    want = state or ("stopped" if early else "finished")
    assert status["state"] == want, f"status.json {status}; expected {want!r}\n{output}"
    if want == "finished":
        assert status["step"] == status["total_steps"], status
        assert "the end-of-run sample failed" not in result.stdout + result.stderr, output
        tokenizer = config["data"]["mode"] != "random" or config["data"]["tokenizer"]  # random tokens: none to sample
        if config["train"]["sample_tokens"] and config["parallel"]["pp"] == 1 and tokenizer:
            # the sample continues a prompt from the run's own data: never empty
            assert re.search(r"^       sample  \s*\S", result.stdout, re.M), f"no end-of-run sample\n{output}"


def start(run_dir: Path, *overrides: str, nproc: int | None = 2, preexec_fn=None,
          fresh: bool = False) -> subprocess.Popen | Forked:
    """Start training the tiny model in the background, in a session of its own (for signals and kills);
    `nproc=None` runs one rank without the `--nproc` launcher; `fresh`: in a new interpreter (see `popen`). A run
    the test leaves running is killed after it."""
    args = [f"--set={o}" for o in (*TINY, f"train.run_dir={run_dir}", *overrides)]
    proc = popen(["-m", "clustertrain", "train", *(["--nproc", str(nproc)] if nproc else []), *args],
                 preexec_fn=preexec_fn, fresh=fresh)
    STARTED.append(proc)
    return proc


def kill_started() -> None:
    """Kill every run start() began that still runs, with all its processes (ranks live in their own sessions)."""
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.communicate()


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it. The whole tree is read first: a killed parent's children move
    to another parent."""
    for p in descendants(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (children, their children, ...), parents first."""
    tree, by_parent = [pid], _children_by_parent()
    for p in tree:  # grows while it is walked
        tree += by_parent.get(p, [])
    return tree


def _children_by_parent() -> dict[int, list[int]]:
    by_parent: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            by_parent.setdefault(ppid, []).append(int(stat.parent.name))
    return by_parent


class RunProcesses:
    """Watches the processes of a run that `start` began, while it runs: its session and the sessions its `--nproc`
    ranks lead, with every process in them (DataLoader workers stay in their rank's). `left()`, after the run
    exits: those still alive, killed then, so that none outlives the test."""

    def __init__(self, proc: subprocess.Popen | Forked):
        self.sessions, self.names = {proc.pid}, {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(proc.pid,), daemon=True)
        self._thread.start()

    def _watch(self, pid: int) -> None:
        while not self._done.wait(0.02):
            for p in descendants(pid)[1:]:
                with contextlib.suppress(OSError, IndexError, ValueError):
                    self.sessions.add(int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[3]))
                    self.names[p] = Path(f"/proc/{p}/comm").read_text().strip()

    def left(self, grace_s: float = 1.0) -> dict[int, str]:
        """{pid: name} of the run's processes alive `grace_s` after its exit (a kill takes a moment)."""
        self._done.set()
        self._thread.join()
        deadline, left = time.monotonic() + grace_s, {}
        while time.monotonic() < deadline:
            left = {}
            for stat in Path("/proc").glob("[0-9]*/stat"):
                with contextlib.suppress(OSError, IndexError, ValueError):
                    fields = stat.read_text().rsplit(")", 1)[1].split()
                    if int(fields[3]) in self.sessions and fields[0] != "Z":
                        left[int(stat.parent.name)] = (stat.parent / "comm").read_text().strip()
            if not left:
                break
            time.sleep(0.05)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return left


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
    return _children_by_parent().get(pid, [])


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def losses(run_dir: Path) -> dict[int, float]:
    """step -> training loss from a run's metrics.jsonl (later records win, as after a resume)."""
    return {r["step"]: r["loss"] for r in read_metrics(Path(run_dir) / "metrics.jsonl") if r.get("loss") is not None}


def grad_norms(run_dir: Path) -> dict[int, float]:
    """step -> gradient norm from a run's metrics.jsonl."""
    return {r["step"]: r["grad_norm"] for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "grad_norm" in r}


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
    from clustertrain.distributed.spawn import free_port

    return str(free_port())


def write_tiny_repo(folder: Path) -> Path:
    """A folder laid out as a hub model repo: a tiny random Llama and a locally trained byte-level BPE tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         vocab_size=128)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=["<eos>"], show_progress=False)
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(folder)
    return folder


def write_docs_and_sft(root: Path, count: int = 300) -> None:
    """`count` records each in root/docs.jsonl (short documents, several to a 64-token row) and root/sft.jsonl
    (prompts and completions of many lengths, so rows hold different numbers of loss tokens)."""
    rng = random.Random(0)
    words = ["the", "river", "sang", "slowly", "def", "return", "class", "import", "stone", "light"]
    with (root / "docs.jsonl").open("w") as f:
        for _ in range(count):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(3, 25)))}) + "\n")
    with (root / "sft.jsonl").open("w") as f:
        for _ in range(count):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            completion = " ".join([str(a + b), *rng.choices(words, k=rng.choice([0, 0, 1, 4, 12]))])
            f.write(json.dumps({"prompt": f"What is {a} plus {b}? ", "completion": completion}) + "\n")


def run_ranks(rank_fn, run_dir: Path, overrides: list[str]) -> None:
    """Start `rank_fn(rank, world, port, overrides, out)` on 2 spawned ranks that train into `run_dir` (given as
    `train.run_dir` first in `overrides`; `out` is `run_dir` as a string), and check that the run finished."""
    import torch.multiprocessing as mp

    from clustertrain.distributed.spawn import free_port

    for attempt in range(3):  # the free port can be taken before rank 0 binds it: then the run fails at once
        try:
            mp.start_processes(rank_fn, args=(2, free_port(), [f"train.run_dir={run_dir}", *overrides], str(run_dir)),
                               nprocs=2, start_method="spawn")
            break
        except Exception as e:  # noqa: BLE001 - only a taken port is retried
            if PORT_TAKEN not in str(e) or attempt == 2:
                raise
    assert read_status(RunDir(run_dir))["state"] == "finished"


SLOW_WRITE_ENV = "CLUSTERTRAIN_TEST_SLOW_CHECKPOINT_WRITE_S"
# Imported by every Python process started with it on PYTHONPATH (a sitecustomize module): a rank's shard write
# sleeps first, as on a slow file system, while SLOW_WRITE_ENV is set.
SLOWED_WRITER = f"""
import os, time
from torch.distributed.checkpoint import FileSystemWriter

_write_data = FileSystemWriter.write_data

def write_data(self, plan, planner):
    time.sleep(float(os.environ.get({SLOW_WRITE_ENV!r}, "0")))
    return _write_data(self, plan, planner)

FileSystemWriter.write_data = write_data
"""


def slow_checkpoint_writes(monkeypatch, folder: Path, seconds: float) -> None:
    """Processes started from now on write their checkpoint shards `seconds` late (until SLOW_WRITE_ENV is unset)."""
    (folder / "sitecustomize.py").write_text(SLOWED_WRITER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(SLOW_WRITE_ENV, str(seconds))
