# flatten_mm: `make demo` and `make test` work on a fresh machine (they install first).
PY := .venv/bin/python
WORK ?= work_dirs/demo

.PHONY: install test demo clean-venv

install:
	@bash tools/install_env.sh

test: install
	$(PY) -m pytest -q

demo: install
	@bash tools/demo.sh $(WORK)

clean-venv:
	rm -rf .venv
