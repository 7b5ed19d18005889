"""`clustertrain train --nproc N`: start N local ranks of the same command, as torchrun would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(nproc: int, argv: list[str]) -> int:
    """Run `python -m clustertrain *argv` as `nproc` ranks on this host and wait for them.

    The first rank that fails stops the others. Signals sent to this process (SIGTERM, SIGUSR1, SIGINT)
    are forwarded to every rank so they can checkpoint. Returns the first non-zero exit code, else 0.
    """
    port = free_port()
    threads = max(1, len(os.sched_getaffinity(0)) // nproc)
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", str(threads))
        procs.append(subprocess.Popen([sys.executable, "-m", "clustertrain", *argv], env=env))

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        return _wait(procs)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wait(procs: list[subprocess.Popen]) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            return failed[0] if failed[0] > 0 else 128 - failed[0]  # killed by signal N: 128 + N, as shells say
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)
