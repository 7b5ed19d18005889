"""The `--nproc` launcher's hold on its ranks: held-back signals, a parent-death signal, process groups; and a
process that ends its own children and theirs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers import alive, descendants

from clustertrain.distributed.spawn import _libc, _rank_setup, _wait

LISTEN = "from clustertrain.distributed.stop import listen_early\nwith listen_early() as early: print(early.received)"


def test_a_signal_to_a_rank_before_it_listens_waits_for_it():
    code = f"import os, signal\nos.kill(os.getpid(), signal.SIGTERM)  # before it listens: held\n{LISTEN}"
    rank = subprocess.Popen([sys.executable, "-c", code], preexec_fn=_rank_setup(os.getpid(), _libc()),
                            stdout=subprocess.PIPE, text=True)
    stdout, _ = rank.communicate(timeout=60)
    assert rank.returncode == 0 and stdout.strip() == f"[{int(signal.SIGTERM)}]"


def test_the_cli_listens_for_stop_signals_before_torch_loads():
    """Importing torch takes a second or more; a Ctrl-C or SIGTERM in it must already find the early listener."""
    code = ("import sys; from clustertrain.cli import train_cmd; from clustertrain.distributed.stop import listen_early; "
            "from clustertrain.distributed import spawn; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_a_rank_dies_with_its_launcher():
    # The launcher starts a rank that would sleep for a minute, prints its pid, then is killed hard.
    launcher = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time\nfrom clustertrain.distributed.spawn import _libc, _rank_setup\n"
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


def test_the_first_rank_to_fail_decides_and_one_killed_by_a_signal_is_named(capsys):
    def rank(code: str) -> subprocess.Popen:  # a session of its own, as a real rank; SIGTERM not held: it dies at once
        return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)

    sleeper = "import time; time.sleep(60)"
    assert _wait([rank(sleeper), rank("raise SystemExit(2)")]) == 2  # the other is stopped, its exit not counted
    assert capsys.readouterr().err == ""  # a rank that exits says why itself
    assert _wait([rank(sleeper), rank("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")]) == 137
    assert capsys.readouterr().err == "error: rank 1 was killed by SIGKILL (out of memory? the kernel's OOM killer " \
                                      "sends it: see `dmesg`)\n"


def test_a_process_ends_every_process_it_started_and_theirs():
    """What a rank does before `os._exit` (a hang): its DataLoader workers, and anything they started, end."""
    code = ("import subprocess, sys\nfrom clustertrain.distributed.spawn import end_descendants\n"
            "subprocess.Popen(['sh', '-c', 'sleep 60 & sleep 60'])\nsubprocess.Popen(['sleep', '60'])\n"
            "sys.stdin.readline()\nend_descendants()\nprint('ended', flush=True)\nsys.stdin.readline()")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(started := descendants(parent.pid)[1:]) < 4 and time.monotonic() < deadline:  # sh, 3 sleeps
        time.sleep(0.02)
    assert len(started) == 4, started
    parent.stdin.write("end\n")
    parent.stdin.flush()
    assert parent.stdout.readline() == "ended\n"
    deadline = time.monotonic() + 10  # a SIGKILL is delivered, not waited for: a loaded machine takes a moment
    while (left := [pid for pid in started if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not left  # the grandchild too: read before its parent was killed
    parent.communicate("exit\n", timeout=30)
