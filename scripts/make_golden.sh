#!/usr/bin/env bash
# Regenerates the golden stores experiments/golden/<experiment>.zarr on tiny_random (`make golden`): one for each
# experiments/golden/<experiment>.args, which lists the overrides it is made with (one a line, # comments).
# `make verify` reruns each from its own provenance and compares: bit for bit where the machine's kernel path
# (CPU model and ISA, threads, dtype, torch, vLLM) is the one recorded here, within measured tolerances elsewhere,
# with generated tokens teacher-forced to the golden ones.
# Engines run in float32 whatever the experiment says ("auto" is bfloat16 on some CPUs only), eager, on the
# tiny_random weights pinned in interp_runner/models/tiny_random.py (built or checked first).
# After changing what an experiment computes, regenerate them and commit the new stores with the change.
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1
RUN=".venv/bin/interp-run"
GOLDEN=experiments/golden
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

.venv/bin/python -m interp_runner.models.materialize tiny_random

golden() {  # NAME OVERRIDES...: one store, Hydra's run folder thrown away
  local name="$1"; shift
  # the report and log are companions the store lists: with the store gone, the store claim refuses them, so they go
  rm -rf "$GOLDEN/$name.zarr" "$GOLDEN/$name.zarr.report.html" "$GOLDEN/$name.zarr.log"
  "$RUN" "+experiment=$name" model=tiny_random engine=eager engine.dtype=float32 "$@" \
    "store.path=$GOLDEN/$name.zarr" "hydra.run.dir=$scratch/$name"
  rm -f "$GOLDEN/$name.zarr.log"  # this machine's paths and times: not committed
  du -sh "$GOLDEN/$name.zarr"
}

for args in "$GOLDEN"/*.args; do
  mapfile -t overrides < <(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$args")
  golden "$(basename "$args" .args)" "${overrides[@]}"
done
