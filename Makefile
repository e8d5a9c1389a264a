# The two commands a new user runs: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vllm-router (deploy/fleet.py, tests/deploy/test_router.py) in its own environment
ROUTER_VENV := .venv-router
ROUTER_STAMP := $(ROUTER_VENV)/.installed

.PHONY: serve test lint bench clean router

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

$(ROUTER_STAMP): deploy/router/requirements.txt
	test -d $(ROUTER_VENV) || $(PY) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/pip install --quiet -r deploy/router/requirements.txt
	touch $(ROUTER_STAMP)

router: $(ROUTER_STAMP)

serve: $(STAMP)
	$(BIN)/spyre-serve serve --model granite-tiny --host 127.0.0.1 --port 8000

test: $(STAMP) $(ROUTER_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/card.py
	$(BIN)/python benchmarks/model.py
	$(BIN)/python benchmarks/serving.py

clean:
	rm -rf $(VENV) $(ROUTER_VENV) build dist *.egg-info
