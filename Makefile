# The two commands a new user needs: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev,tensorboard,hf,fp8]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/gpuflow train --workload digits

test: lint
	$(BIN)/python -m pytest -q

# lint-imports keeps packages apart; tools/import_cycles.py, modules inside one package;
# tools/module_sizes.py, modules within 400 lines and functions within 80.
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks tools
	$(BIN)/lint-imports
	$(BIN)/python tools/import_cycles.py
	$(BIN)/python tools/module_sizes.py

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/scaling.py
	$(BIN)/python benchmarks/lockstep.py
	$(BIN)/python benchmarks/compare_trainers.py
	test ! -f benchmarks/serving.py || $(BIN)/python benchmarks/serving.py
	$(BIN)/python benchmarks/render_docs.py

clean:
	rm -rf $(VENV) runs
