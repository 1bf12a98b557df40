# sandlot: `make demo` runs the server with a snapshot/fork demo; `make test` runs the tests
# (Python and TypeScript; `make test-ts` only the TypeScript ones); `make ci` runs CI here.
SHELL := /bin/bash
VENV := .venv/bin
PORT ?= 7070

.PHONY: setup demo serve test test-unit test-ts docs-ts lint bench bench-quick break ci clean

setup:
	@scripts/setup.sh

demo: setup
	@scripts/demo.sh $(PORT)

serve: setup
	$(VENV)/sandlot serve --port $(PORT)

test: setup
	@scripts/test.sh

test-unit: setup
	$(VENV)/python -m pytest tests/unit -q

test-ts: setup
	$(VENV)/python -m pytest tests/ts -q -ra

docs-ts: setup
	cd sdk-ts && npm run --silent docs

# CI on this host: .ci/run in a fresh clone of HEAD (CI=true), then a check that the run left
# nothing running (scripts/ci.sh, scripts/leftovers.py).
ci:
	@scripts/ci.sh

lint:
	$(VENV)/ruff check src tests bench examples scripts

bench: setup
	$(VENV)/python bench/run.py --json bench/results/full.json

bench-quick: setup
	$(VENV)/python bench/run.py --quick --json bench/results/quick.json

# The loops that try to break sandlot (docs/security.md): crash, concurrency, abuse, fuzz.
break: setup
	$(VENV)/python bench/break.py all

clean:
	rm -rf .stamps
