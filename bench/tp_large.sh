#!/usr/bin/env bash
# Tensor parallelism at 4 (and 8) GPUs on a Llama-3-70B-shaped model with seeded random weights
# (`model.weights: seeded`: no weight files, the same tensors at every TP size). Logs and results go under $OUT
# (default ./gpu-out); a short table is printed last.
#
#   bash bench/tp_large.sh                       # setup tests bench trace
#   bash bench/tp_large.sh setup tests           # some stages, in the order given
#
# Stages: setup (bench/gpu_check.sh's: install + local models + versions), tests (tests/test_gpu_tp_large.py:
# 70B at TP = 4 with steering, capture and patching, ranks' checksums equal; TP = 4 against TP = 2 on a 70B-width
# 8-layer model and, with 8 GPUs, TP = 8 against TP = 4 at 70B, teacher-forced bfloat16), bench
# (bench/steer_overhead.py on the 70B shape at TP = $TP, vLLM's dummy weights: idle, steered and capture,
# paired-interval method), trace (`python -m interp_runner +experiment=causal_trace` on the 70B folder at TP = $TP:
# $TRACE_FACTS facts, every layer; wall time and cells per second).
# GPU_CHECK_BUDGET_S (default 540) bounds the whole run: each stage gets what is left, and a stage is skipped when
# under 60 s are left. Under a 10-minute limit per command, split the stages over calls, e.g. `setup tests`, then
# `setup bench trace`. Knobs: TP (default 4), BENCH_REPEATS (default 7), BENCH_ARGS, TRACE_FACTS (default 3),
# TRACE_ARGS (more overrides). With fewer than 4 GPUs every stage but setup refuses.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu-out}
mkdir -p "$OUT"
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(setup tests bench trace)
BUDGET=${GPU_CHECK_BUDGET_S:-540}
PY=${PYTHON:-python3}
SITE_IR=${INTERP_SITE:-/tmp/site-ir}
TP=${TP:-4}
SHAPE_70B=8192,80,64,8,28672,128256  # hidden, layers, heads, KV heads, intermediate, vocab (Llama-3-70B)
FOLDER_70B=${FOLDER_70B:-/tmp/interp-bench/llama70b-seeded}

main() {
  local t_start=$SECONDS
  [ -f /tmp/gpu-env.sh ] && . /tmp/gpu-env.sh
  export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  unset PYTHONDONTWRITEBYTECODE
  export PYTHONPATH=$SITE_IR${PYTHONPATH:+:$PYTHONPATH}  # the installed copy (made by setup), as gpu_check.sh
  left() { echo $(( BUDGET - (SECONDS - t_start) )); }
  declare -A RC SECS
  local failed=0 gpus
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)

  for stage in "${STAGES[@]}"; do
    local t0=$SECONDS rc=0 budget
    budget=$(left)
    echo "=== stage $stage ($(date -u +%H:%M:%S), ${budget}s of budget left, $gpus GPUs)"
    if [ "$budget" -lt 60 ]; then
      RC[$stage]="skipped (budget)"; continue
    fi
    if [ "$stage" != setup ] && [ "$gpus" -lt "$TP" -o "$gpus" -lt 4 ]; then
      echo "$stage: needs at least 4 GPUs and TP = $TP of them; this machine has $gpus"
      RC[$stage]="refused ($gpus GPUs)"; failed=1; continue
    fi
    case $stage in
      setup) GPU_CHECK_BUDGET_S=$budget OUT=$OUT/setup bash bench/gpu_check.sh setup || rc=$? ;;
      tests) stage_tests "$budget" || rc=$? ;;
      bench) stage_bench "$budget" || rc=$? ;;
      trace) stage_trace "$budget" || rc=$? ;;
      *) echo "unknown stage $stage"; rc=2 ;;
    esac
    RC[$stage]=$rc; SECS[$stage]=$(( SECONDS - t0 ))
    [ "$rc" = 0 ] || failed=1
  done

  {
    echo
    echo "=== 70B tensor-parallel summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), $gpus x $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
    for stage in "${STAGES[@]}"; do
      printf '%-10s rc=%-18s %ss\n' "$stage" "${RC[$stage]:-?}" "${SECS[$stage]:--}"
    done
    if [ -f "$OUT/pytest_tp_large.log" ]; then
      echo "tests: $(grep -E '[0-9]+ (passed|failed|skipped|errors?)( |,|$)|no tests ran' "$OUT/pytest_tp_large.log" | tail -1)"
      grep -E '^(FAILED|ERROR) ' "$OUT/pytest_tp_large.log" | head -20
    fi
    [ -f "$OUT/tp_large_report.txt" ] && cat "$OUT/tp_large_report.txt"
    if [ -f "$OUT/bench_llama70b_tp$TP.json" ]; then
      $PY bench/steer_overhead.py --report "$OUT/bench_llama70b_tp$TP.json"
      capture_goal "$OUT/bench_llama70b_tp$TP.json"
    fi
    [ -f "$OUT/trace_70b.txt" ] && cat "$OUT/trace_70b.txt"
  } | tee "$OUT/summary_tp_large.txt"
  return "$failed"
}

stage_tests() {
  local budget=$1 log=$OUT/pytest_tp_large.log
  rm -f "$OUT/tp_large_report.txt"
  INTERP_GPU_REPORT="$OUT/tp_large_report.txt" timeout -k 10 $(( budget - 5 )) \
    $PY -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests/test_gpu_tp_large.py 2>&1 | tee "$log"
  return "${PIPESTATUS[0]}"
}

stage_bench() {  # steering and capture against idle on one interp engine (the table's goal for capture is 3%)
  local budget=$1
  timeout -k 10 $(( budget - 5 )) $PY bench/steer_overhead.py --model llama8b-random --llama-shape "$SHAPE_70B" \
    --weights dummy --tp "$TP" --engines interp --conditions idle,steered,capture \
    --repeats "${BENCH_REPEATS:-7}" --worker-timeout $(( budget - 20 )) ${BENCH_ARGS:-} \
    --json "$OUT/bench_llama70b_tp$TP.json"
}

capture_goal() {  # the 70B goals: steering <= +1% time, capture <= 2% throughput, on the paired 95% interval
  $PY - "$1" <<'EOF'
import json, sys
sys.path.insert(0, "bench")
from paired import median_interval, paired_changes, paired_ratios
res = json.load(open(sys.argv[1]))
for w in res["workers"]:
    if w.get("kind") != "interp" or "times_s" not in w:
        continue
    changes = paired_changes(w["times_s"])
    for cond, goal in (("steered", lambda c: c <= 0.01), ("capture", lambda c: 1 / (1 + c) - 1 >= -0.02)):
        if cond not in changes:
            continue
        limit = "time <= +1%" if cond == "steered" else "throughput >= -2%"
        interval = median_interval(paired_ratios(w["times_s"], cond))
        if interval is None:
            print(f"70B goal {cond} vs idle ({limit}): paired {changes[cond]:+.2%}, too few rounds for an interval")
            continue
        lo, hi = interval
        met = "yes" if goal(lo) and goal(hi) else "NO" if not (goal(lo) or goal(hi)) else "noise"
        print(f"70B goal {cond} vs idle ({limit}): paired {changes[cond]:+.2%}, 95% interval [{lo:+.2%}, {hi:+.2%}]"
              f" -> {met}")
EOF
}

stage_trace() {  # a causal trace of a few facts at every layer of the 70B shape
  local budget=$1 t0 rc=0
  $PY -m interp_runner.models.seeded "$FOLDER_70B" || return 1
  rm -rf /tmp/interp-trace-70b
  t0=$(date +%s%N)
  timeout -k 10 $(( budget - 15 )) $PY -m interp_runner +experiment=causal_trace model.name=llama70b \
    model.path="$FOLDER_70B" +model.weights=seeded +model.seed=0 engine.dtype=bfloat16 \
    engine.tensor_parallel_size="$TP" engine.max_model_len=256 causal_trace.num_facts="${TRACE_FACTS:-3}" \
    causal_trace.layers=all causal_trace.filter=false causal_trace.plots=false \
    store.path=/tmp/interp-trace-70b/results.zarr hydra.run.dir=/tmp/interp-trace-70b ${TRACE_ARGS:-} \
    2>&1 | tee "$OUT/trace_70b.log"
  rc=${PIPESTATUS[0]}
  local wall_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  [ "$rc" = 0 ] || return "$rc"
  $PY - /tmp/interp-trace-70b/results.zarr "$wall_ms" <<'EOF' | tee "$OUT/trace_70b.txt"
import sys
import numpy as np
import xarray as xr
ds = xr.open_zarr(sys.argv[1], consolidated=False)
wall, t = int(sys.argv[2]) / 1000, ds.attrs["timings"]
runs = int(np.isfinite(ds["restored_logprob_samples"].values).sum())  # (cell, noise sample) runs with a result
samples = ds.sizes["sample"]
print(f"70B causal trace: {ds.sizes.get('fact', '?')} facts x {ds.sizes.get('component', '?')} components x "
      f"{ds.attrs['model']['num_layers']} layers: {runs // samples} cells x {samples} noise samples, "
      f"voided {len(ds.attrs.get('voided', []))}; process wall {wall:.1f} s (engine start {t.get('engine_s')} s, "
      f"run {t.get('run_s')} s): {runs // samples / wall:.1f} cells/s whole, "
      f"{runs // samples / t['run_s']:.1f} cells/s run")
EOF
  rc=${PIPESTATUS[0]}
  cp -r /tmp/interp-trace-70b/results.zarr "$OUT/trace_70b.zarr" 2>/dev/null || true
  return "$rc"
}

main 2>&1 | tee -a "$OUT/tp_large.log"
exit "${PIPESTATUS[0]}"
