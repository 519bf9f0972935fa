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
# Elsewhere (CPU machines, CI) the pinned set in constraints.txt is installed.
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
	  $(PY) -m pip install -q -c constraints.txt -e ".[dev]"; \
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
