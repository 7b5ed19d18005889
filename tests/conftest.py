"""Shared fixtures. Helpers that start real ranks live in tests/helpers.py."""

from __future__ import annotations

import os

import pytest

# One intra-op thread for the test process and everything it starts, set before anything imports torch: the tiny
# models gain nothing from more, and threads spinning for cores that other tests hold slow every run down.
os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


@pytest.fixture(scope="session", autouse=True)
def shared_cache(tmp_path_factory):
    """One tokenizer/token cache for the whole session (and its child processes)."""
    root = os.environ.get("CLUSTERTRAIN_TEST_CACHE") or str(tmp_path_factory.getbasetemp().parent / "clustertrain-cache")
    os.environ["CLUSTERTRAIN_CACHE"] = root
    yield root


@pytest.fixture(autouse=True)
def no_run_left_running():
    """A run a test started in the background (helpers.start) does not outlive the test, ranks included."""
    yield
    from helpers import kill_started

    kill_started()


@pytest.fixture(autouse=True)
def logging_and_environment_as_they_were():
    """A test that runs the CLI in-process (main()) leaves no --log-level, handler or library verbosity behind, and
    one that imports a library which sets variables (lm-eval sets HF_XET_HIGH_PERFORMANCE) leaves the environment
    as it was: the fork server forks a command only for the environment it imported with."""
    import logging

    env = dict(os.environ)
    loggers = {name: logging.getLogger(name) for name in ("clustertrain", "py.warnings")}
    state = {name: (list(lg.handlers), lg.level, lg.propagate) for name, lg in loggers.items()}
    yield
    for name, (handlers, level, propagate) in state.items():
        loggers[name].handlers[:], loggers[name].propagate = handlers, propagate
        loggers[name].setLevel(level)
    logging.captureWarnings(False)
    if dict(os.environ) != env:
        os.environ.clear()
        os.environ.update(env)
