"""Hostile launches, resumes and downloads (issue 22): each is one line that says what happened, with its exit code.

In this process where no second one is needed (a port already taken, a resume past the budget, the start line);
real processes for what only a process shows: a rank killed by SIGKILL, a download stopped by SIGTERM.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock
from helpers import TINY, children, start, wait_for_step, write_tiny_repo

from clustertrain.cli import main
from clustertrain.errors import ExitCode
from clustertrain.run_dir import RunDir
from clustertrain.train.status import read_status


def tiny_train(run_dir: Path, *overrides: str) -> list[str]:
    return ["train", *(f"--set={o}" for o in (*TINY, f"train.run_dir={run_dir}", "train.sample_tokens=0", *overrides))]


def test_master_port_in_use_with_env_launched_ranks_is_one_line(tmp_path, monkeypatch, capsys):
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set as torchrun or srun would, and the port already taken."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(name, value)
        code = main(tiny_train(tmp_path / "run"))
    assert code == 2
    assert capsys.readouterr().err == (f"error: MASTER_PORT {port} is already in use on 127.0.0.1 (EADDRINUSE: "
                                       "another run or program listens there); set MASTER_PORT to a free port\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.dist  # trains the tiny model in this process
def test_resume_with_fewer_steps_than_the_checkpoint_is_refused_and_changes_nothing(tmp_path, capsys):
    assert main(tiny_train(tmp_path, "train.steps=4")) == 0
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    status = read_status(RunDir(tmp_path))
    capsys.readouterr()
    assert main(tiny_train(tmp_path, "train.steps=2")) == 2  # it printed "step 4/2" and exited 0
    checkpoint = tmp_path / "checkpoints" / "step-0000004"
    assert capsys.readouterr().err == (f"error: train.steps = 2 is below the checkpoint's step 4 ({checkpoint}); set "
                                       "train.steps to train past step 4, or start over with --resume none "
                                       "--overwrite\n")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == saved
    assert read_status(RunDir(tmp_path)) == status


@pytest.mark.dist  # trains a tiny GPT-2 in this process
def test_the_start_line_names_the_family_built_not_model_arch(tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    snapshot = write_tiny_repo(tmp_path / "gpt2")  # its tokenizer, and a Llama that the GPT-2 replaces
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=1, n_head=2)
                                     ).save_pretrained(snapshot)
    args = [f"model.path={snapshot}", f"train.run_dir={tmp_path / 'run'}", "data.seq_len=32", "train.steps=1",
            "train.global_batch_size=2", "train.eval_every=0", "train.sample_tokens=0", "metrics.progress=lines",
            "data.sources=[{format: stdlib, max_bytes: 100000}]", "data.num_workers=0"]
    assert main(["train", *(f"--set={o}" for o in args)]) == 0  # model.arch stays its default, llama
    out = capsys.readouterr().out
    assert "clustertrain: gpt2 " in out and "clustertrain: llama" not in out, out[:500]


@pytest.mark.dist
def test_a_rank_killed_under_nproc_is_the_launchers_line_not_rank_0s_traceback(tmp_path):
    proc = start(tmp_path, "train.steps=500", "checkpoint.every=0")
    wait_for_step(tmp_path, 1, proc)
    ranks = sorted(children(proc.pid))  # started in rank order
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, stderr[-3000:]
    assert "Traceback" not in stderr and "GLHF" not in stderr, stderr[-3000:]  # gloo's 34 lines on rank 0
    launcher, rank0 = stderr.splitlines()
    assert launcher == "error: rank 1 was killed by SIGKILL (out of memory? the kernel's OOM killer sends it: see `dmesg`)"
    # Rank 0 names the rank from its heartbeat, not "lost its connection to another rank".
    assert re.fullmatch(rf"error: rank 1 \(host \S+, pid {ranks[1]}\) died without a word \(its last heartbeat, "
                        r"\d+ s ago, in [^;]+; killed\? out of memory\? see `dmesg` on its host\)", rank0), rank0
    status = read_status(RunDir(tmp_path))
    assert status["state"] == "failed" and status["error"] == rank0.removeprefix("error: "), status


ETAG = "a" * 64
# `clustertrain download` against a stand-in for the hub, which is not what is under test: like the hub client,
# it streams one big file into blobs/<etag>.<random>.incomplete from a worker thread, under the blob's lock.
SLOW_HUB = f"""
import sys, time, uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import huggingface_hub
from filelock import FileLock
from huggingface_hub.errors import LocalEntryNotFoundError

def snapshot_download(repo_id, repo_type=None, cache_dir=None, local_files_only=False, **options):
    if local_files_only:
        raise LocalEntryNotFoundError("not in the cache")
    folder = Path(cache_dir) / "models--org--big"
    (folder / "blobs").mkdir(parents=True)
    (Path(cache_dir) / ".locks" / folder.name).mkdir(parents=True)

    def stream():
        with FileLock(Path(cache_dir) / ".locks" / folder.name / "{ETAG}.lock"):
            with open(folder / "blobs" / f"{ETAG}.{{uuid.uuid4().hex[:8]}}.incomplete", "wb") as f:
                while True:
                    f.write(bytes(1 << 16))
                    f.flush()
                    time.sleep(0.005)

    with ThreadPoolExecutor(1) as pool:
        pool.submit(stream).result()

huggingface_hub.snapshot_download = snapshot_download
from clustertrain.cli import main
sys.exit(main(["download", "org/big", "--cache-dir", sys.argv[1]]))
"""


def test_a_download_stopped_by_sigterm_says_so_removes_its_partial_file_and_exits_75(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SLOW_HUB, str(tmp_path)], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "0"})
    blobs = tmp_path / "models--org--big" / "blobs"
    deadline = time.monotonic() + 60
    while sum(p.stat().st_size for p in blobs.glob("*.incomplete")) < 1 << 20:  # under way: a MiB written
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)  # at once: the stream would never end by itself
    assert proc.returncode == ExitCode.REQUEUE, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the download of org/big was stopped by SIGTERM; its "
                                                   "partial files ("), stderr
    assert lines[0].endswith("removed, complete files kept: run the same command again to finish it")
    assert list(blobs.iterdir()) == []


def test_the_next_download_removes_partial_files_that_a_killed_one_left(tmp_path, capsys):
    source = write_tiny_repo(tmp_path / "source")
    cache = tmp_path / "cache"
    blobs = cache / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    stale = blobs / f"{ETAG}.0badf00d.incomplete"  # as a download killed by SIGKILL leaves it
    stale.write_bytes(bytes(3000))
    running = blobs / f"{'b' * 64}.12345678.incomplete"  # another process is downloading it: it holds the lock
    running.write_bytes(bytes(10))
    (cache / ".locks" / "models--org--tiny").mkdir(parents=True)
    with FileLock(cache / ".locks" / "models--org--tiny" / f"{'b' * 64}.lock"):
        assert main(["download", "org/tiny", "--from-dir", str(source), "--cache-dir", str(cache)]) == 0
    assert "removed 3.0 KB of partial files that a stopped download of org/tiny had left" in capsys.readouterr().out
    assert not stale.exists() and running.exists()
