# flatten_mm: `make demo` and `make test` work on a fresh machine (they install first).
PY := .venv/bin/python
WORK ?= work_dirs/demo
# the suite runs in this many pytest-xdist workers (CI's 2 cores); 0 runs it in one process
TEST_JOBS ?= 2

.PHONY: install test demo clean-venv

install:
	@bash tools/install_env.sh

test: install
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal

demo: install
	@bash tools/demo.sh $(WORK)

clean-venv:
	rm -rf .venv
