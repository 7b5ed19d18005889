"""Run `python -m clustertrain ...` for tests without paying for torch's and transformers' imports each time.

A server process imports them once (per pytest worker) and forks a child for each command; under `--nproc`,
that child forks its ranks in turn (`clustertrain.distributed.spawn.start_rank`), so a 2-rank run starts in a
fraction of a second instead of three interpreters' 5 to 10 s. A child runs the CLI's own entry function with
the command's environment, working directory, stdout and stderr (pipes passed over a Unix socket), in a
session of its own, and ends as an interpreter would: non-daemon threads joined, atexit handlers run.

What a fork cannot reproduce runs in a fresh interpreter (`helpers.run_cli`/`start` decide, see `can_fork`):
an environment that differs from the server's in what is read at import (PYTHONPATH, HF_*, TORCH_*, ...), and
tests of what happens while torch imports.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# Read when Python or these libraries start (or import): a command whose environment differs here is not forked.
IMPORT_TIME_ENV = ("PYTHON", "LD_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "CUDA_", "OMP_",
                   "MKL_", "TOKENIZERS_")
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2", "peft", "tokenizers",
           "safetensors.torch", "clustertrain.cli", "clustertrain.train.trainer"]


def _import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


def _as_imported(argv: list[str], env: dict[str, str]) -> dict[str, str]:
    """The environment `clustertrain ARGV` imports transformers with: every command but `download` goes offline
    first (`clustertrain.cli.work_offline`), as the server did."""
    from clustertrain.cli import work_offline

    env = dict(env)
    if argv[:1] != ["download"]:
        work_offline(env)
    return env


# ---------------------------------------------------------------- the server and what its children run


def serve(address: str) -> None:
    """Import what every command needs, then fork a child per request until the test process goes away."""
    from clustertrain.cli import work_offline
    from clustertrain.distributed.spawn import _libc

    libc = _libc()
    if libc is not None:
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG: leave with the pytest worker
    work_offline()
    for module in PRELOAD:
        __import__(module)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection its exit code goes to
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
                request = json.loads(message)
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    for fd in (listener.fileno(), wake_r, wake_w, conn.fileno()):
                        os.close(fd)
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.setsid()
                    os.dup2(fds[0], 1)
                    os.dup2(fds[1], 2)
                    for fd in fds:
                        os.close(fd)
                    os.chdir(request["cwd"])
                    run_command(request["argv"], request["env"])
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                waiting[pid] = conn
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if conn := waiting.pop(pid, None):
                with contextlib.suppress(OSError):
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()


def run_command(argv: list[str], env: dict[str, str]) -> None:
    """Be `python -m clustertrain ARGV` in this (forked) process with environment `env`, and exit as it would."""
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [str(Path(__import__("clustertrain").__file__).parent / "__main__.py"), *argv]
    import clustertrain.distributed.spawn as spawn

    spawn.start_rank = fork_rank
    try:
        from clustertrain.cli import main

        code = main(argv)
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - shown as the interpreter would, then exit 1
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # what the interpreter does at exit: join non-daemon threads (an async save)
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code or 0)


class ForkedRank:
    """The part of `subprocess.Popen` the `--nproc` launcher uses, for a rank forked from it."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def fork_rank(argv: list[str], env: dict[str, str], setup) -> ForkedRank:
    """`spawn.start_rank` for a launcher that was itself forked: the rank is a fork, not a new interpreter."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            setup()
            run_command(argv, env)
        finally:
            os._exit(1)
    return ForkedRank(pid)


# ---------------------------------------------------------------- the test side


class Server:
    """The fork server of this test process, started on first use."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.env: dict[str, str] = {}

    def start(self) -> None:
        folder = tempfile.mkdtemp(prefix="forkserver-")
        self.address = os.path.join(folder, "socket")
        self.env = _as_imported(["train"], dict(os.environ))
        tests = str(Path(__file__).parent)
        self.proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {tests!r}); "
                                      f"import forkserver; forkserver.serve({self.address!r})"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=self.env, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the fork server did not start (exit {self.proc.wait()})")
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def can_fork(self, argv: list[str], env: dict[str, str]) -> bool:
        """Whether `clustertrain ARGV` with environment `env` behaves in a fork of this server as in a new
        interpreter: what it reads at import is what the server read."""
        if os.environ.get("CLUSTERTRAIN_TEST_NO_FORK"):
            return False
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        return _import_env(_as_imported(argv, env)) == _import_env(self.env)

    def popen(self, argv: list[str], env: dict[str, str], cwd: str | Path | None = None) -> Forked:
        return Forked(self.address, argv, env, str(cwd or os.getcwd()))


SERVER = Server()


class Forked:
    """A `python -m clustertrain ARGV` forked by the server, with the part of `subprocess.Popen` tests use:
    `pid`, `returncode`, `stdout` and `stderr` (text pipes), `poll`, `wait`, `communicate`, `send_signal`."""

    def __init__(self, address: str, argv: list[str], env: dict[str, str], cwd: str):
        self.args = [sys.executable, "-m", "clustertrain", *argv]
        self.returncode: int | None = None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._conn = socket.socket(socket.AF_UNIX)
        self._conn.connect(address)
        socket.send_fds(self._conn, [json.dumps(dict(argv=argv, env=env, cwd=cwd)).encode()], [out_w, err_w])
        os.close(out_w)
        os.close(err_w)
        self.stdout = open(out_r, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed by communicate
        self.stderr = open(err_r, encoding="utf-8", errors="replace")  # noqa: SIM115
        self._reply = self._conn.makefile("r")
        self.pid = int(self._reply.readline())
        self._output: dict[str, list[str]] = {}
        self._readers: list[threading.Thread] = []

    def poll(self) -> int | None:
        if self.returncode is None and _readable(self._conn, 0):
            self._read_code()
        return self.returncode

    def _read_code(self) -> None:
        line = self._reply.readline()
        self.returncode = int(line) if line else -signal.SIGKILL  # the server died: so did it, most likely
        self._conn.close()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not _readable(self._conn, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_code()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read stdout and stderr to their end and wait for the exit, as Popen.communicate (may be called again
        after a TimeoutExpired)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._readers:
            for name, stream in (("stdout", self.stdout), ("stderr", self.stderr)):
                chunks = self._output[name] = []
                self._readers.append(threading.Thread(target=_drain, args=(stream, chunks), daemon=True))
                self._readers[-1].start()
        for reader in self._readers:
            reader.join(None if deadline is None else max(0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0, deadline - time.monotonic()))
        return "".join(self._output["stdout"]), "".join(self._output["stderr"])

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _readable(conn: socket.socket, timeout: float | None) -> bool:
    with selectors.DefaultSelector() as selector:
        selector.register(conn, selectors.EVENT_READ)
        return bool(selector.select(timeout))


def _drain(stream, chunks: list[str]) -> None:
    with stream:
        while chunk := stream.read(65536):
            chunks.append(chunk)
