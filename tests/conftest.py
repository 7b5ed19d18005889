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
