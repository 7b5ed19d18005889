"""Every Slurm job a test submits ends with the test, passed or failed: none is left queued or running."""

from __future__ import annotations

import pytest
from slurmjobs import SUBMITTED, cancel_jobs


@pytest.fixture(autouse=True)
def cancel_leftover_jobs():
    yield
    while SUBMITTED:
        cancel_jobs(SUBMITTED.pop())
