PY := .venv/bin/python
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1

.PHONY: setup run test test-fast golden verify lock gpu-check bench clean

setup:            ## venv + locked packages + built-in models
	bash scripts/setup.sh

run:              ## causal tracing on the embedded SmolLM2
	.venv/bin/interp-run +experiment=causal_trace

# pytest-xdist processes. `test` gives each worker whole files (files sharing a process of their own go together:
# tests/support/xdist_lanes.py) and one OpenMP thread (tests/conftest.py); TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2

test:             ## the whole CPU test suite
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test-fast:        ## unit tests only (no engine, no process of its own, nothing slow)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not engine and not cli and not slow"

golden:           ## regenerate the golden stores experiments/golden/*.zarr (tiny_random)
	bash scripts/make_golden.sh

verify:           ## rerun every golden store from its provenance and compare (exact on CPU)
	@set -e; for store in experiments/golden/*.zarr; do \
	  echo "== $$store"; $(PY) -m interp_runner.verify "$$store" --rerun; done

lock:             ## re-resolve requirements/*.lock from requirements/*.in
	python3 -m uv pip compile --python-version 3.11 requirements/cpu.in -o requirements/cpu.lock
	python3 -m uv pip compile --python-version 3.12 --python-platform x86_64-manylinux_2_28 requirements/gpu.in -o requirements/gpu.lock

gpu-check:        ## on a GPU machine: GPU tests + first benchmark, results under $$OUT (or ./gpu-out)
	bash bench/gpu_check.sh

clean:
	rm -rf outputs multirun .pytest_cache
