# Set-up and everyday commands. The venv sees an already-installed torch (a cluster's ROCm/CUDA build);
# torch==2.13.0 (CPU here) is installed only when none is importable, so pip never resolves CUDA wheels.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: install
	rm -rf runs/demo
	$(VENV)/bin/clustertrain train --nproc 2 --set train.run_dir=runs/demo

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

test-fast: install
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not dist"

bench: install
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) runs *.egg-info
