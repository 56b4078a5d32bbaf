# The two commands of the README: `make demo` and `make test`. Both create .venv on first use and install
# pinned dependencies (constraints.txt pins torch==2.13.0); later runs reuse it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/torchrun --standalone --nproc_per_node=2 -m shardtrain.cli.demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(BIN)/python bench/bench_zero.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
