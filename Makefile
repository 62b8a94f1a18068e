# make: .venv with the pinned requirements and the lab installed editable (the `lab` command).
# make study: build .venv if needed, then reproduce the default study.  make test: the test suite.
# make test-kernel-paths: the numerics, formats, FP8 and RL-path tests again on ATen's default (generic) kernels.
# make test-slurm: the SLURM profile end to end on a one-node cluster on localhost (root; installs slurm-wlm).
PYTHON ?= python3
VENV := .venv
CORES ?= $(shell nproc 2>/dev/null || echo 2)
CONFIG ?=
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: study test test-studies test-kernel-paths test-slurm lint bench claims clean-results

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

# the tests whose numbers come from ATen's CPU kernels (numerics and the FP16 contract, the formats, FP8, the RL
# paths) once more under ATen's default capability: other kernels than the CPU's own (AVX2, AVX-512), so that a test
# holding for one kernel's bits only fails in CI (docs/testing.md). test_formats_kernels.py by two of its tests, the
# compiled accumulator model and NVFP4 quantizer against the eager ones (the rest compile for minutes)
KERNEL_PATH_TESTS := tests/test_numerics.py tests/test_autocast.py tests/test_fp16_cpu.py \
	tests/test_fp16_cpu_transposed.py tests/test_fp16_cpu_mutants.py tests/test_fp16_loss.py tests/test_positions.py \
	tests/test_accumulate.py tests/test_emulated_accum.py tests/test_contract_vs_cuda.py tests/test_record_accum.py \
	tests/test_formats_api.py tests/test_formats_blocks.py \
	tests/test_formats_kernels.py::test_compiled_accumulator_model_is_the_eager_model_bit_for_bit \
	tests/test_formats_kernels.py::test_compiled_nvfp4_kernel_is_the_eager_quantizer_bit_for_bit \
	tests/test_fp8_linear.py tests/test_fp8_census.py tests/test_fp8_vs_scaled_mm.py tests/test_integrations_fp8.py \
	tests/test_predictors.py tests/test_rl_paths.py tests/test_rl_mismatch_cuda.py tests/test_rl_dpo.py
test-kernel-paths: $(VENV)/.installed
	ATEN_CPU_CAPABILITY=default python -m pytest $(KERNEL_PATH_TESTS)

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
