"""tests/gpu: the paths that only run on a GPU, run on one (`make test-gpu` on a GPU node, under 8 minutes on one
H100). Without a CUDA device every test here is skipped, in one line: CPU tests reach these paths only through
their fallbacks."""

from __future__ import annotations

import pytest
import torch

NO_GPU = "no CUDA device: tests/gpu needs one GPU (make test-gpu on a GPU node)"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # A skip raised here (not a marker, nor a fixture) is reported at this one line for every test.
    if not torch.cuda.is_available():
        pytest.skip(NO_GPU)
