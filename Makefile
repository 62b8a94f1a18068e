# make: .venv with the pinned requirements and the lab installed editable (the `lab` command).
# make study: build .venv if needed, then reproduce the default study.  make test: the test suite.
# make test-slurm: the SLURM profile end to end on a one-node cluster on localhost (root; installs slurm-wlm).
PYTHON ?= python3
VENV := .venv
CORES ?= $(shell nproc 2>/dev/null || echo 2)
CONFIG ?=
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: study test test-studies test-slurm lint bench claims clean-results

# the pinned requirements, then the lab itself, editable (its `lab` command: pyproject.toml's [project.scripts]),
# so that `lab diagnose runs/mine` works from any folder once .venv/bin is on PATH (source .venv/bin/activate)
$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -r requirements.txt
	$(VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

study: $(VENV)/.installed
	python -m lab validate $(foreach c,$(CONFIG),--config $(c))
	snakemake --cores $(CORES) $(if $(CONFIG),--configfile $(CONFIG),)

test: $(VENV)/.installed
	python -m pytest

# the tests marked `study` (pyproject.toml): the verdict procedure calibrated by simulation, the GPU check rehearsed on
# the CPU; checks that measure, kept out of the suite's 10 minutes and run by CI after it (docs/budgets.md)
test-studies: $(VENV)/.installed
	python -m pytest -m study

test-slurm: $(VENV)/.installed
	bash workflow/tests/slurm_e2e.sh

lint: $(VENV)/.installed
	snakemake --lint

# the source study's claims against results/tables/summary.csv, into the README's claims section; and fp16-amax
# against fp16-dynamic, paired by seed, into its compare section
claims: $(VENV)/.installed
	python -m lab claims --readme README.md
	python -m lab compare results --left fp16-amax --right fp16-dynamic --readme docs/policies.md > /dev/null

bench: $(VENV)/.installed
	python benchmarks/speed/bench_fp16_cpu.py
	python benchmarks/speed/bench_scaler.py
