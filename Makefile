# Set-up and everyday commands. The venv sees an already-installed torch (a cluster's ROCm/CUDA build);
# torch==2.13.0 (CPU here) is installed only when none is importable, so pip never resolves CUDA wheels.
# A torch older than clustertrain supports stops the install before pip runs (clustertrain/torch_check.py).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast test-oldest bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m clustertrain.torch_check
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

# The oldest supported torch (PyPI's build: CUDA, run on the CPU here) on a smoke subset: 1 rank, 2-rank zero3
# with resume, LoRA and its export; then the exports load under transformers 4.57 (tests/compat/export_compat.py).
OLDEST := .venv-oldest
OLDEST_TORCH := 2.8.0
SMOKE := 'tests/distributed/test_train.py::test_every_layout_ends_with_a_sample_of_its_own_data[single]' \
	'tests/distributed/test_train.py::test_layout_matches_one_rank[zero3]' \
	'tests/distributed/test_train.py::test_resume_matches_uninterrupted[zero3]' \
	'tests/distributed/test_finetune.py::test_lora_learns_and_leaves_the_base_bit_identical[zero3]' \
	tests/distributed/test_finetune.py::test_adapter_export_loads_in_peft_and_merged_export_matches_it
TRANSFORMERS4 := 'transformers>=4.57,<5' 'huggingface_hub<1' 'tokenizers>=0.22,<0.23' requests urllib3 idna \
	charset_normalizer certifi

test-oldest: install
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet torch==$(OLDEST_TORCH) -e ".[dev]"
	$(OLDEST)/bin/python -m pytest -q -n 2 -p no:cacheprovider $(SMOKE)
	rm -rf $(OLDEST)/compat && $(PY) tests/compat/export_compat.py write $(OLDEST)/compat
	$(OLDEST)/bin/python -m pip install --quiet --no-deps --upgrade --target $(OLDEST)/transformers4 $(TRANSFORMERS4)
	PYTHONPATH=$(OLDEST)/transformers4 $(OLDEST)/bin/python tests/compat/export_compat.py check $(OLDEST)/compat

bench: install
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) $(OLDEST) runs *.egg-info
