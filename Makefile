# The two commands of the README: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs (torch pinned to
# the CPU build available here; the package with its dev extras).
PY := .venv/bin/python
STAMP := .venv/.shardwise-installed

.PHONY: demo test bench venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	.venv/bin/shardwise demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	.venv/bin/shardwise bench

clean:
	rm -rf .venv build *.egg-info
