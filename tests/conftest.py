"""Shared fixtures. Helpers that start real ranks live in tests/helpers.py."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def shared_cache(tmp_path_factory):
    """One tokenizer/token cache for the whole session (and its child processes)."""
    root = os.environ.get("CLUSTERTRAIN_TEST_CACHE") or str(tmp_path_factory.getbasetemp().parent / "clustertrain-cache")
    os.environ["CLUSTERTRAIN_CACHE"] = root
    yield root
