# Set-up and everyday commands. The venv sees an already-installed torch (a cluster's ROCm/CUDA build);
# torch==2.13.0 (CPU here) is installed only when none is importable, so pip never resolves CUDA wheels.
# A torch older than clustertrain supports stops the install before pip runs (clustertrain/torch_check.py).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The venv sees the site-packages of $(PYTHON)'s own installation; where $(PYTHON) is itself in a venv (a node's
# torch is often installed in one), a .pth file adds that venv's site-packages too, after the new venv's own.
MAKE_VENV = test -x $(PY) || { $(PYTHON) -m venv --system-site-packages $(VENV) && $(PYTHON) -c "import site, sys; \
	print('\n'.join(site.getsitepackages()) if sys.prefix != sys.base_prefix else '')" > "$$($(PY) -c \
	'import sysconfig; print(sysconfig.get_path("purelib"))')/outer-venv.pth"; }

.PHONY: install demo test test-fast mutants test-oldest test-gpu wheelhouse bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(MAKE_VENV)
	$(PY) -m clustertrain.torch_check
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: install
	rm -rf runs/demo
	$(VENV)/bin/clustertrain train --nproc 2 --set train.run_dir=runs/demo
	$(VENV)/bin/clustertrain plot runs/demo

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

test-fast: install
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not dist"

# Classic training faults (tests/mutants.yaml) planted one at a time in a copy of the repo: which the tests catch.
mutants: install
	$(PY) scripts/mutants.py --baseline

# The oldest supported torch and transformers together (PyPI's torch build: CUDA, run on the CPU here) on a smoke
# subset: 1 rank, 2-rank zero3 with resume, LoRA and its export, all trained under transformers 4.57 and torch 2.8;
# then exports written with the project's transformers 5 load under 4.57 with the same logits, and a 4.57 run trains
# on the tokenizer a 5 run cached (tests/compat/export_compat.py).
OLDEST := .venv-oldest
OLDEST_TORCH := 2.8.0
OLDEST_TRANSFORMERS := 4.57.*
SMOKE := 'tests/distributed/test_train.py::test_every_layout_ends_with_a_sample_of_its_own_data[single]' \
	'tests/distributed/test_train.py::test_layout_matches_one_rank[zero3]' \
	'tests/distributed/test_train.py::test_resume_matches_uninterrupted[zero3]' \
	'tests/distributed/test_finetune.py::test_lora_learns_and_leaves_the_base_bit_identical[zero3]' \
	tests/distributed/test_finetune.py::test_adapter_export_loads_in_peft_and_merged_export_matches_it \
	tests/unit/model/test_weights.py

test-oldest: install
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet torch==$(OLDEST_TORCH) -e ".[dev]" "transformers==$(OLDEST_TRANSFORMERS)"
	$(OLDEST)/bin/python -c "import torch, transformers; assert transformers.__version__.startswith('4.57.') \
		and torch.__version__.startswith('$(OLDEST_TORCH)'), (torch.__version__, transformers.__version__)"
	$(OLDEST)/bin/python -m pytest -q -n 2 -p no:cacheprovider $(SMOKE)
	rm -rf $(OLDEST)/compat && $(PY) tests/compat/export_compat.py write $(OLDEST)/compat
	$(OLDEST)/bin/python tests/compat/export_compat.py check $(OLDEST)/compat

# tests/gpu on this node's GPU in one command (under 8 minutes on one H100; `bench/gpu.py --steps 5` included);
# without a GPU every test is skipped, with one line saying why. The venv sees the node's torch and never installs
# one. With a package index this is `make install`; without one (compute nodes often have torch and no index),
# clustertrain and its dependencies come from wheelhouse/, made by `make wheelhouse` where there is an index.
WHEELHOUSE := wheelhouse
GPU_WORKERS ?= 4
NO_WHEELHOUSE = error: no $(WHEELHOUSE)/ here: run 'make wheelhouse PYVER=$$($(PY) -c 'import sys; \
	print("%d.%d" % sys.version_info[:2])')' where there is a package index, and copy $(WHEELHOUSE)/ here
NO_TORCH = error: $(PY) sees no torch: install your cluster's build (README: 'Which torch'); make test-gpu never \
	installs one
GPU_PYTEST = $$($(PY) -c "import torch; print('-n $(GPU_WORKERS) --dist loadfile --durations=15' \
	if torch.cuda.is_available() else '')")

test-gpu:
	$(MAKE_VENV)
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then :; \
	elif $(PY) -m pip index versions pip --retries 0 --timeout 10 >/dev/null 2>&1; then \
		$(MAKE) --no-print-directory install; \
	else \
		echo "no package index is reachable: installing from $(WHEELHOUSE)/ (--no-index), with the torch already here"; \
		test -d $(WHEELHOUSE) || { echo "$(NO_WHEELHOUSE)" >&2; exit 2; }; \
		$(PY) -c "import torch" 2>/dev/null || { echo "$(NO_TORCH)" >&2; exit 2; }; \
		$(PY) -m clustertrain.torch_check && \
		$(PY) -m pip install --quiet --no-index --find-links $(WHEELHOUSE) -e ".[dev]" && touch $(STAMP); \
	fi
	$(PY) -m pytest -q -rs -p no:cacheprovider $(GPU_PYTEST) tests/gpu

# `make wheelhouse [PYVER=3.12] [TORCH_VERSION=2.9.1]`: clustertrain's dependencies and dev tools, torch aside, as
# wheels for Python PYVER (default: this python3's) on x86-64 Linux, into wheelhouse/. While pip resolves, a
# metadata-only stand-in for the node's torch (TORCH_VERSION, default the oldest supported) satisfies peft's and
# accelerate's requirement, so neither torch nor its CUDA wheels are downloaded.
PYVER ?= $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
TORCH_VERSION ?= $(OLDEST_TORCH)
WHEEL_TARGET = --only-binary=:all: --python-version $(PYVER) \
	$(addprefix --platform ,manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
RESOLVE := $(WHEELHOUSE)/.resolve
STAND_IN := torch-$(TORCH_VERSION)+node

wheelhouse:
	$(MAKE_VENV)
	rm -rf $(WHEELHOUSE) && mkdir -p $(RESOLVE)
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir $(RESOLVE) .
	$(PY) -c "import sys, zipfile; info = '$(STAND_IN).dist-info/'; z = zipfile.ZipFile(sys.argv[1], 'w'); \
		z.writestr(info + 'METADATA', 'Metadata-Version: 2.1\nName: torch\nVersion: $(TORCH_VERSION)+node\n'); \
		z.writestr(info + 'WHEEL', 'Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n'); \
		z.writestr(info + 'RECORD', ''); z.close()" $(RESOLVE)/$(STAND_IN)-py3-none-any.whl
	$(PY) -m pip install --quiet --dry-run --ignore-installed $(WHEEL_TARGET) --target $(RESOLVE)/target \
		--find-links $(RESOLVE) --report $(RESOLVE)/report.json "torch==$(TORCH_VERSION)+node" \
		"$$(ls $(RESOLVE)/clustertrain-*.whl)[dev]" "setuptools>=68"
	$(PY) -c "import json, sys; print('\n'.join('%s==%s' % (p['metadata']['name'], p['metadata']['version']) \
		for p in json.load(open(sys.argv[1]))['install'] if p['metadata']['name'] not in ('torch', 'clustertrain')))" \
		$(RESOLVE)/report.json > $(RESOLVE)/pins.txt
	$(PY) -m pip download --quiet --no-deps $(WHEEL_TARGET) --dest $(WHEELHOUSE) -r $(RESOLVE)/pins.txt
	rm -rf $(RESOLVE)
	@echo "$(WHEELHOUSE)/: $$(ls $(WHEELHOUSE) | wc -l) wheels ($$(du -sh $(WHEELHOUSE) | cut -f1)) for Python $(PYVER);" \
		"on a node without a package index, make test-gpu installs from it"

bench: install
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) $(OLDEST) runs *.egg-info
