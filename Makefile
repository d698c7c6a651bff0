# The commands of the README: `make demo`, `make test`, `make test-budget`, `make lint` and `make docs`.
# Each creates .venv when missing and installs what it needs (torch pinned to
# the CPU build available here; the package with its dev extras).
PY := .venv/bin/python
STAMP := .venv/.shardwise-installed

.PHONY: demo test test-fast lint format bench venv clean docs docs-check

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	.venv/bin/shardwise demo

# Two pytest workers (pytest-xdist): ranks spend much of a test waiting, and one pytest process left a third of
# the two reference cores idle. Tests go to the workers one by one (--dist load): a fixture shared by several
# tests (a module's launch, the session's shared `shardwise run`) may run once in each worker. Grouping the
# tests that share one (--dist loadgroup) does nothing with pytest 9.2, whose node ids xdist 3.8 cannot suffix
# (pytest-xdist issue 1386). `make test WORKERS=0` runs the suite in one process; WORKERS=auto starts one worker per core.
WORKERS ?= 2
XDIST := -n $(WORKERS)
# Compiled modules are kept (__pycache__, ignored by git) even where the environment sets PYTHONDONTWRITEBYTECODE:
# every pytest worker compiles the test modules again otherwise (8 s of its 25 s collection), and every fresh rank
# process the package's modules. An empty value lets Python write them; the suite's subprocesses inherit it.
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest

# The 15 slowest tests close every run's output (CI's log included), so a slow newcomer shows where it lands.
test: $(STAMP)
	$(PYTEST) -q $(XDIST) --durations=15

# The edit-run loop (under 2 minutes): the planner's unit tests and one equivalence file per
# paradigm; CI and the README's `make test` run everything.
FAST := tests/plan tests/fit/test_memory_check.py tests/parallel/dp/test_dp.py tests/parallel/pp/test_naive_mp.py \
	tests/parallel/dp/test_ddp.py tests/parallel/dp/test_zero.py tests/parallel/dp/test_fsdp.py \
	tests/parallel/dp/test_offload.py tests/parallel/tp/test_tp.py tests/parallel/pp/test_pipeline.py \
	tests/parallel/ps/test_ps.py tests/checkpoint/test_checkpoint.py tests/strategies/test_hf_models.py

test-fast: $(STAMP)
	$(PYTEST) -q $(XDIST) $(FAST) -k "not dies_or_hangs"

# ruff (the rules and the format in pyproject.toml's [tool.ruff]) over the tree; mypy over shardwise/ at the
# strictness of [tool.mypy] (DEVELOPERS.md). Both pinned in the dev extra.
lint: $(STAMP)
	.venv/bin/ruff check .
	# .venv/bin/ruff format --check .   # on once `make format` keeps every function under 80 lines (DEVELOPERS.md)
	.venv/bin/mypy

# Rewrites the tree in the format `make lint` checks (ruff format, settings in pyproject.toml's [tool.ruff.format]).
format: $(STAMP)
	.venv/bin/ruff format .

# The whole suite with its 15 slowest tests, then its time against the budget (tests/budget_report.py): a
# report, not a timed test. The log stays in build/ for a second look; pytest's exit status is make's.
BUDGET_LOG := build/test-budget.log

.PHONY: test-budget
test-budget: $(STAMP)
	mkdir -p build
	{ $(PYTEST) -q $(XDIST) --durations=15; echo $$? > $(BUDGET_LOG).rc; } 2>&1 | tee $(BUDGET_LOG)
	$(PY) tests/budget_report.py $(BUDGET_LOG)
	@exit $$(cat $(BUDGET_LOG).rc)

# tests/gpu on the GPU machine (skipped without CUDA; `make test` collects and skips them). docs/gpu.md.
# A GPU machine's own python3 has torch with CUDA, and often no network to install the venv's pinned CPU
# wheel: when python3 sees CUDA (and has pytest), the tests run with it, this checkout first on its path;
# anywhere else in the venv, where they skip.
.PHONY: test-gpu
test-gpu:
	@if python3 -c "import sys, pytest, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
		echo "test-gpu: python3 with CUDA torch"; PYTHONPATH=$(CURDIR) python3 -m pytest -q -rs tests/gpu; \
	else \
		$(MAKE) venv && $(PY) -m pytest -q -rs tests/gpu; \
	fi

# The site, into site/ (docs/conf.py says why Sphinx): every warning is an error (-W), a link to a missing page
# or heading included; -n checks references to shardwise's public names; -E reads every page each time, so a
# warning cannot hide in a page that did not change. The docs extra goes into .venv once (its own stamp).
DOCS_STAMP := .venv/.shardwise-docs-installed

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	rm -rf site
	$(PY) -m sphinx -E -W --keep-going -n -b html -d build/doctrees docs site

# The built site in a real browser (Debian's headless Chromium, installed here when missing and run as root):
# screenshots into build/docs-check/, the search must find "ZeRO", no page may ask for a missing file.
docs-check: docs
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		{ echo "docs-check: needs Debian's chromium (apt-get install -y chromium)"; exit 2; }
	$(PY) docs/check_site.py --site site --out build/docs-check

bench: $(STAMP)
	.venv/bin/shardwise bench

clean:
	rm -rf .venv build site *.egg-info .mypy_cache .ruff_cache
