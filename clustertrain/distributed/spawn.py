"""`clustertrain train --nproc N`: start N local ranks of the same command, as torchrun would; and the run's own
processes, which never outlive it.

Ranks die with their launcher: each starts with a parent-death signal (SIGKILL, see `_rank_setup`) in a
session (so a process group) of its own, as torchrun's do: the launcher can take a rank down with its
DataLoader workers, and a terminal's Ctrl-C reaches only the launcher, which forwards it. Stop signals
are held back in a new rank until it listens for them (clustertrain.distributed.stop.listen_early), so none
is lost or fatal while Python and torch start. Once every rank has ended, the launcher kills what is left of
each rank's process group (the workers of a rank that was killed).

Under any launcher (torchrun, srun, mpirun, plain python), DataLoader workers die with their rank
(`die_with_parent`, a parent-death signal), and a process that ends by `os._exit` (the watchdog's hang exit, a
SIGTERM once the exit code is decided) first kills what it started (`end_descendants`): such an exit skips the
DataLoader's shutdown, and a worker blocked writing to its result pipe would live on, orphaned.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from clustertrain.distributed.stop import STOP_SIGNALS, EarlySignals

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(nproc: int, argv: list[str], early: EarlySignals | None = None) -> int:
    """Run `python -m clustertrain *argv` as `nproc` ranks on this host and wait for them.

    The first rank that fails stops the others. Signals sent to this process (SIGTERM, SIGUSR1, SIGINT)
    are forwarded to every rank so they can checkpoint, those in `early` (received before the ranks
    existed) included; at a second SIGINT the ranks stop at once, and so does this launcher. Returns the
    first non-zero exit code, else 0.
    """
    port = free_port()
    threads = max(1, len(os.sched_getaffinity(0)) // nproc)
    setup = _rank_setup(os.getpid(), _libc())
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(nproc):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env.setdefault("OMP_NUM_THREADS", str(threads))
            procs.append(start_rank(argv, env, setup))
    except BaseException:
        _kill(procs)
        raise
    interrupts = 0

    def forward(signum, _frame):
        nonlocal interrupts
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
        interrupts += signum == signal.SIGINT
        if interrupts == 2:
            raise KeyboardInterrupt

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        for signum in early.received if early else ():
            forward(signum, None)
        return _wait(procs)
    except KeyboardInterrupt:  # the ranks got the second Ctrl-C too and exit at once: give them a moment
        _kill(procs, grace_s=5)
        return 128 + signal.SIGINT
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def start_rank(argv: list[str], env: dict[str, str], setup: Callable[[], None]) -> subprocess.Popen:
    """Start one rank: `python -m clustertrain ARGV` with environment `env`, `setup` run between fork and exec.
    (The test suite's fork server replaces it with a fork of the launcher: tests/forkserver.py.)"""
    return subprocess.Popen([sys.executable, "-m", "clustertrain", *argv], env=env, preexec_fn=setup)


def _rank_setup(launcher: int, libc: ctypes.CDLL | None) -> Callable[[], None]:
    """What a rank does between fork and exec: its own session, stop signals held, die with the launcher.

    A session rather than only a process group: a background group of the terminal's session would be
    stopped (SIGTTOU) for writing progress to a terminal set to `tostop`. The parent-death signal is
    SIGKILL, not SIGTERM: a launcher that dies without forwarding a signal was killed hard (SIGKILL, the
    OOM killer), and ranks that went on to save would race the next launch on the same run directory;
    the last checkpoint is intact either way.
    """
    def setup() -> None:
        os.setsid()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # pending until the rank's CLI listens
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != launcher:  # the launcher died before prctl
                os.kill(os.getpid(), signal.SIGKILL)
    return setup


def die_with_parent(parent: int, *_: object) -> None:
    """In a child of process `parent` (a DataLoader's `worker_init_fn`, with `functools.partial`): die by SIGKILL
    when the thread that started this process ends, and now if `parent` has ended already. That thread must live
    as long as the process (the trainer's main thread iterates its loaders)."""
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def end_descendants() -> None:
    """SIGKILL every process this one started and theirs, read from /proc (nothing where there is none)."""
    by_parent: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            by_parent.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
    tree = list(by_parent.get(os.getpid(), []))
    for pid in tree:  # grows while it is walked: the whole tree is read before a kill reparents a grandchild
        tree += by_parent.get(pid, [])
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _libc() -> ctypes.CDLL | None:
    """The C library, for prctl; None where there is no parent-death signal (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _kill(procs: list[subprocess.Popen], grace_s: float = 0) -> None:
    """Kill the ranks still running after `grace_s` seconds, and every rank's process group: the DataLoader
    workers of a rank killed by a signal live on in it. (A group's id is not another's while a member lives, nor
    before the pids wrap around.)"""
    deadline = time.monotonic() + grace_s
    # a stopped rank (SIGSTOP, a debugger) cannot act on SIGTERM: no use waiting for it
    while any(p.poll() is None and not _stopped(p.pid) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _wait(procs: list[subprocess.Popen]) -> int:
    """Wait for the ranks; at the first that fails, stop the others and return its exit code. The ranks report
    their own errors (clustertrain/distributed/failures.py); a rank killed by a signal cannot, so this says it."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            if code < 0:  # first: what the other ranks then say of their lost connection comes after it
                hint = (" (out of memory? the kernel's OOM killer sends it: see `dmesg`)"
                        if -code == signal.SIGKILL else "")
                print(f"error: rank {rank} was killed by {_signal_name(-code)}{hint}", file=sys.stderr, flush=True)
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            _kill(procs, grace_s=30)
            return code if code > 0 else 128 - code  # killed by signal N: 128 + N, as shells say
        if all(c == 0 for c in codes):
            _kill(procs)
            return 0
        time.sleep(0.1)


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T in /proc; False where that cannot be read)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
