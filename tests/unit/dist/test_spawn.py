"""The `--nproc` launcher's hold on its ranks: held-back signals, a parent-death signal, process groups."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers import alive

from clustertrain.dist.spawn import _libc, _rank_setup

LISTEN = "from clustertrain.dist.spawn import listen_early\nwith listen_early() as early: print(early.received)"


def test_a_signal_to_a_rank_before_it_listens_waits_for_it():
    code = f"import os, signal\nos.kill(os.getpid(), signal.SIGTERM)  # before it listens: held\n{LISTEN}"
    rank = subprocess.Popen([sys.executable, "-c", code], preexec_fn=_rank_setup(os.getpid(), _libc()),
                            stdout=subprocess.PIPE, text=True)
    stdout, _ = rank.communicate(timeout=60)
    assert rank.returncode == 0 and stdout.strip() == f"[{int(signal.SIGTERM)}]"


def test_a_rank_dies_with_its_launcher():
    # The launcher starts a rank that would sleep for a minute, prints its pid, then is killed hard.
    launcher = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time\nfrom clustertrain.dist.spawn import _libc, _rank_setup\n"
        "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "preexec_fn=_rank_setup(os.getpid(), _libc()))\nprint(rank.pid, flush=True)\ntime.sleep(60)"
    )], stdout=subprocess.PIPE, text=True)
    rank = int(launcher.stdout.readline())
    assert os.getpgid(rank) == rank
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(rank):
        time.sleep(0.05)
    assert not alive(rank)
