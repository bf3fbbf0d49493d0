#!/usr/bin/env bash
# The GPU check: install the package (so vLLM finds the plugin through its entry point), build the local
# models, run the GPU tests, then the benchmarks. Logs and results go under $OUT
# (default ./gpu-out); a short table is printed last.
#
#   bash bench/gpu_check.sh                      # setup tests kernels bench-small
#   bash bench/gpu_check.sh setup tests          # some stages, in the order given
#
# Stages: setup (install + models + versions), tests (pytest -m gpu: tests/test_gpu.py, tests/test_kernels.py),
# kernels (bench/kernels.py: bandwidth of each kernel against a device copy, host time a call), bench-small
# (SmolLM2: steering and capture overhead), bench-8b (random-weight 8B-shaped Llama), bench-v2 (SmolLM2 on stock
# vLLM with its default model runner, V2), bench-trace (causal-tracing grids against hand-batched HF hooks:
# bench/trace_grid.py),
# bench-store (bench/store_bandwidth.py: a large capture written to zarr against dd on the same filesystem),
# startup (bench/run_wall.py: whole `interp-run` processes of WALL_CONFIG, default +experiment=causal_trace_full,
# with WALL_ARGS such as `--variant eager:engine.enforce_eager=true --repeats 2`; result $OUT/$WALL_JSON.json),
# overlap (bench/start_overlap.py: the plan compiled before the engine starts or while it does, same config).
# serve-bench (bench/serve_bench.py: interp-serve against stock `vllm serve` of SmolLM2 on one GPU, paired intervals,
# its rounds fitted into the stage's budget; SERVE_ARGS such as `--conditions plain,steer100`).
# GPU_CHECK_BUDGET_S (default 540) bounds the whole run: each stage gets what is left, and a stage is skipped
# when under 30 s are left. Under a 10-minute limit per command, split the stages over calls, e.g.
# `setup tests kernels bench-trace`, then `setup bench-small bench-store bench-8b`. Environment knobs:
# BENCH_ENGINES, BENCH_8B_ENGINES, BENCH_CONDITIONS, BENCH_8B_CONDITIONS, BENCH_REPEATS, TRACE_REPEATS, TRACE_ARGS
# (more bench/trace_grid.py options), TRACE_JSON (its result file's name), BENCH_ARGS (more steer_overhead.py
# options), BENCH_SUFFIX (appended to the bench result files' names), STORE_DIR, STORE_ARGS (more
# bench/store_bandwidth.py options), TEST_FILES.
# On a machine prepared with the offline bundle, /tmp/gpu-env.sh is sourced first.
# Several of these runs side by side on one machine's GPUs, under one deadline: bench/gpu_lanes.sh.
#
# runners: every one-GPU test file under V1 and under V2 (VLLM_USE_V2_MODEL_RUNNER=0 / 1), the twelve (runner, file
# group) jobs spread over the visible GPUs side by side, logs pytest_v1_*.log and pytest_v2_*.log. RUNNER_ONLY="gpu
# trace" keeps those groups (gpu, trace, verify, families, moe, serve) under both runners, and "v1:gpu v2:serve" a group
# under one runner, in the order named. Jobs go to the GPUs in turn. A group takes 2-8 minutes alone on an H100
# (gpu 130 s, families and moe ~200 s each, verify ~150 s) and up to 3x that with four lanes side by side: on four
# GPUs, plan about four jobs a call.
#
# Two GPUs (nvidia-h100-x2):  bash bench/gpu_check.sh setup tp bench-tp sweep tp-cpu-tests
# tp (tests/test_gpu_tensor_parallel.py: TP = 2 against TP = 1, compiled, float32 and teacher-forced bfloat16),
# bench-tp (bench/steer_overhead.py on the 8B shape, interp engine at TP = 1 then TP = 2; TP_BENCH_ARGS),
# sweep (bench/sweep_wall.sh: one `-m` sweep through the joblib launcher, one engine per GPU, against the same
# sweep on one GPU; SWEEP_ARGS), tp-cpu-tests (tests/test_tensor_parallel.py, eager float32, on the GPUs).
# Launcher wheels carried in .whl/ (hydra-joblib-launcher, ...) are installed first. NVLink multicast stays off
# (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1) in every stage.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu-out}
mkdir -p "$OUT"
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(setup tests kernels bench-small)
BUDGET=${GPU_CHECK_BUDGET_S:-540}
PY=${PYTHON:-python3}
SITE_IR=${INTERP_SITE:-/tmp/site-ir}

main() {
  local t_start=$SECONDS
  [ -f /tmp/gpu-env.sh ] && . /tmp/gpu-env.sh
  export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # inherited by every process
  if ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then  # packages the GPU image lacks (the Hydra launchers)
    flock /tmp/site-wheels.lock \
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-wheels \
      "$REPO"/.whl/*.whl && export PYTHONPATH=/tmp/site-wheels${PYTHONPATH:+:$PYTHONPATH}  # one at a time: GPU lanes
  fi
  # as a user's install does, Python keeps byte-compiled modules (the GPU image turns that off: each process would
  # compile every module it imports again, ~19 s of an `interp-run`)
  unset PYTHONDONTWRITEBYTECODE
  # the installed copy of the live tree (made by `setup`) supplies the package, its entry point and
  # interp_runner_kernels; `python -m` from the root runs the live tree itself. The root stays off PYTHONPATH, as it is
  # off an installed `interp-run`'s path: its kernels/ would shadow the `kernels` package transformers probes for
  export PYTHONPATH=$SITE_IR${PYTHONPATH:+:$PYTHONPATH}
  left() { echo $(( BUDGET - (SECONDS - t_start) )); }
  declare -A RC SECS
  local failed=0

  for stage in "${STAGES[@]}"; do
    local t0=$SECONDS rc=0 budget
    budget=$(left)
    echo "=== stage $stage ($(date -u +%H:%M:%S), ${budget}s of budget left)"
    if [ "$budget" -lt 30 ]; then
      RC[$stage]="skipped (budget)"; continue
    fi
    case $stage in
      setup) stage_setup || rc=$? ;;
      tests) stage_tests $(( budget < ${TESTS_MAX_S:-360} ? budget : ${TESTS_MAX_S:-360} )) || rc=$? ;;
      bench-small) stage_bench "$budget" smollm2_135m "${BENCH_ENGINES:-interp,stock}" "${BENCH_SUFFIX:-}" || rc=$? ;;
      bench-8b) BENCH_CONDITIONS=${BENCH_8B_CONDITIONS:-idle,steered} \
        stage_bench "$budget" llama8b-random "${BENCH_8B_ENGINES:-${BENCH_ENGINES:-interp,stock}}" "${BENCH_SUFFIX:-}" \
        || rc=$? ;;
      bench-v2) stage_bench "$budget" smollm2_135m stock-default _v2 || rc=$? ;;
      tp) TEST_FILES=tests/test_gpu_tensor_parallel.py stage_tests "$budget" || rc=$? ;;
      tp-cpu-tests) TEST_FILES=tests/test_tensor_parallel.py TEST_MARK=engine TEST_LOG=pytest_tp_cpu \
        stage_tests "$budget" || rc=$? ;;
      bench-tp) stage_bench_tp "$budget" || rc=$? ;;
      runners) stage_runners "$budget" || rc=$? ;;
      sweep) timeout -k 10 $(( budget - 5 )) bash bench/sweep_wall.sh "$OUT/sweep_wall.json" ${SWEEP_ARGS:-} || rc=$? ;;
      kernels) timeout -k 10 $(( budget - 5 )) $PY bench/kernels.py --json "$OUT/kernels.json" || rc=$? ;;
      bench-trace) timeout -k 10 $(( budget - 5 )) $PY bench/trace_grid.py --repeats "${TRACE_REPEATS:-5}" \
        ${TRACE_ARGS:-} --json "$OUT/${TRACE_JSON:-trace_grid}.json" || rc=$? ;;
      startup) timeout -k 10 $(( budget - 5 )) $PY bench/run_wall.py ${WALL_ARGS:-} --dir "${TMPDIR:-/tmp}" \
        --json "$OUT/${WALL_JSON:-run_wall}.json" -- ${WALL_CONFIG:-+experiment=causal_trace_full} || rc=$? ;;
      overlap) timeout -k 10 $(( budget - 5 )) $PY bench/start_overlap.py --repeats "${OVERLAP_REPEATS:-2}" \
        --json "$OUT/start_overlap.json" -- ${WALL_CONFIG:-+experiment=causal_trace_full} || rc=$? ;;
      serve-bench) timeout -k 10 $(( budget - 5 )) $PY bench/serve_bench.py --budget-s $(( budget - 40 )) \
        ${SERVE_ARGS:-} --json "$OUT/serve_bench.json" || rc=$? ;;
      bench-store) timeout -k 10 $(( budget - 5 )) $PY bench/store_bandwidth.py --dir "${STORE_DIR:-/tmp/interp-store-bench}" \
        ${STORE_ARGS:-} --json "$OUT/store_bandwidth.json" || rc=$? ;;
      *) echo "unknown stage $stage"; rc=2 ;;
    esac
    RC[$stage]=$rc; SECS[$stage]=$(( SECONDS - t0 ))
    [ "$rc" = 0 ] || failed=1
  done

  {
    echo
    echo "=== GPU check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
    for stage in "${STAGES[@]}"; do
      printf '%-20s rc=%-16s %ss\n' "$stage" "${RC[$stage]:-?}" "${SECS[$stage]:--}"
    done
    for log in "$OUT"/pytest*.log; do
      [ -f "$log" ] || continue
      echo "tests ($(basename "$log")): $(grep -E '[0-9]+ (passed|failed|skipped|errors?)( |,|$)|no tests ran' "$log" | tail -1)"
      grep -E '^(FAILED|ERROR) ' "$log" | head -20
    done
    [ -f "$OUT/gpu_test_report.txt" ] && cat "$OUT/gpu_test_report.txt"
    ls "$OUT"/bench_*.json >/dev/null 2>&1 && $PY bench/steer_overhead.py --report "$OUT"/bench_*.json
    [ -f "$OUT/sweep_wall.json" ] && cat "$OUT/sweep_wall.json"
    [ -f "$OUT/serve_bench.json" ] && $PY bench/serve_bench.py --report "$OUT/serve_bench.json"
  } | tee "$OUT/summary.txt"
  return "$failed"
}

stage_setup() {
  {
    nvidia-smi || true
    echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"  # hosts differ in speed
    $PY -c "import sys, torch, triton, transformers; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA'); print('triton', triton.__version__, 'transformers', transformers.__version__)"
    $PY -c "import vllm; print('vllm', vllm.__version__)"
    $PY -c "import os, sys, torch, vllm; print('bytecode written:', not sys.dont_write_bytecode, '| writable:', *(os.path.dirname(os.path.dirname(m.__file__)) for m in (torch, vllm) if os.access(os.path.dirname(m.__file__), os.W_OK)))"
  } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
  # a real install, so vLLM discovers the plugin through the vllm.general_plugins entry point
  rm -rf "$SITE_IR"
  local src
  src=$(mktemp -d)  # build from a copy: no build/ or egg-info left in the tree
  cp -r "$REPO/pyproject.toml" "$REPO/README.md" "$REPO/interp_runner" "$REPO/kernels" "$REPO/conf" \
    "$REPO/experiments" "$src/"
  if ! $PY -m pip install -q --no-deps --no-index --no-build-isolation --target "$SITE_IR" "$src"; then
    echo "pip install failed: writing the distribution by hand (same entry point)"
    mkdir -p "$SITE_IR/interp_runner-0.1.0.dist-info"
    cp -r "$REPO/interp_runner" "$SITE_IR/"
    cp -r "$REPO/conf" "$REPO/experiments" "$SITE_IR/interp_runner/"  # shipped inside the package (interp_runner.shipped)
    cp -r "$REPO/kernels" "$SITE_IR/interp_runner_kernels"
    printf 'Metadata-Version: 2.1\nName: interp-runner\nVersion: 0.1.0\n' > "$SITE_IR/interp_runner-0.1.0.dist-info/METADATA"
    printf '[vllm.general_plugins]\ninterp_runner = interp_runner.plugin:register\n' \
      > "$SITE_IR/interp_runner-0.1.0.dist-info/entry_points.txt"
  fi
  $PY - <<'EOF' || return 1
from importlib.metadata import entry_points
eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "interp_runner"]
assert eps, "no vllm.general_plugins entry point named interp_runner"
import interp_runner_kernels
print("plugin entry point:", eps[0].value, "| kernels from", interp_runner_kernels.__file__)
EOF
  local t0=$SECONDS
  $PY -m interp_runner.models.materialize all || return 1
  echo "models ready in $(( SECONDS - t0 )) s"
}

stage_tests() {
  local budget=$1 log=$OUT/${TEST_LOG:-pytest}.log report=$OUT/${TEST_REPORT:-gpu_test_report.txt}
  [ "${TEST_LOG:-pytest}" = pytest ] && rm -f "$report"
  INTERP_GPU_REPORT="$report" timeout -k 10 $(( budget - 5 )) \
    $PY -m pytest -q -m "${TEST_MARK:-gpu}" -p no:cacheprovider --durations=8 \
    ${TEST_FILES:-tests/test_kernels.py tests/test_gpu.py} 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  [ -f "$report" ] && cat "$report"
  return "$rc"
}

# every one-GPU test file under both model runners, the (runner, files) jobs spread over the visible GPUs: each GPU runs
# its jobs in turn, the GPUs side by side; each job's log is pytest_<runner>_<group>.log
RUNNER_GROUPS=("gpu:tests/test_gpu.py tests/test_kernels.py"
               "trace:tests/test_gpu_trace.py tests/test_gpu_nonfinite.py"
               "verify:tests/test_verify_derived.py tests/test_run_log.py"
               "families:tests/test_gpu_phi_gemma.py"
               "moe:tests/test_gpu_gpt_moe.py"
               "serve:tests/test_gpu_serve.py")
stage_runners() {
  local budget=$1 gpus=() jobs=() i=0 rc=0 pids=() t_lanes=$SECONDS
  IFS=, read -r -a gpus <<< "${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd,)}"
  local runner group word
  # RUNNER_ONLY names a group under both runners ("gpu") or under one ("v1:gpu"); its jobs keep the order named
  for word in ${RUNNER_ONLY:-${RUNNER_GROUPS[*]%%:*}}; do
    for group in "${RUNNER_GROUPS[@]}"; do
      [ "${group%%:*}" = "${word#v[12]:}" ] || continue
      for runner in 0 1; do
        [[ $word == v[12]:* ]] && [ "${word:1:1}" != $(( runner + 1 )) ] && continue
        jobs+=("$runner:$group")
      done
    done
  done
  for (( g = 0; g < ${#gpus[@]}; g++ )); do
    (
      local j code=0
      for (( j = g; j < ${#jobs[@]}; j += ${#gpus[@]} )); do
        IFS=: read -r runner name files <<< "${jobs[$j]}"
        # -vv: a lane cut by the budget still names every test that passed
        PYTEST_ADDOPTS="-vv -rfE ${PYTEST_ADDOPTS:-}" \
        CUDA_VISIBLE_DEVICES=${gpus[$g]} VLLM_USE_V2_MODEL_RUNNER=$runner TEST_FILES="$files" \
          TEST_LOG="pytest_v$(( runner + 1 ))_$name" TEST_REPORT="gpu_test_report_v$(( runner + 1 ))_$name.txt" \
          stage_tests $(( budget - (SECONDS - t_lanes) )) > /dev/null 2>&1 || code=1
        free_gpu "${gpus[$g]}"
      done
      exit $code
    ) &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i" || rc=1; done
  return "$rc"
}

# the processes a job left on GPU $1 (a server its test had no time to stop when the lane's budget ran out), killed
# so that the next job finds the GPU's memory free; logged in $OUT/leftovers.log
free_gpu() {
  local bus pids
  bus=$(nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader 2>/dev/null | awk -F', ' -v g="$1" '$1 == g {print $2}')
  [ -n "$bus" ] || return 0
  pids=$(nvidia-smi --query-compute-apps=pid,gpu_bus_id --format=csv,noheader 2>/dev/null \
    | awk -F', ' -v b="$bus" '$2 == b {print $1}')
  [ -n "$pids" ] || return 0
  echo "$(date -u +%H:%M:%S) GPU $1: killing $(echo $pids)" >> "$OUT/leftovers.log"
  kill -9 $pids 2>/dev/null
  sleep 3
}

stage_bench_tp() {  # the interp engine's overheads at TP = 1, then TP = 2, same workload and machine
  local budget=$1 tp rc=0 t0=$SECONDS
  for tp in 1 2; do
    local left=$(( budget - (SECONDS - t0) ))
    [ "$left" -lt 60 ] && { echo "bench-tp: no budget left for TP = $tp"; return 1; }
    timeout -k 10 $(( left - 5 )) $PY bench/steer_overhead.py --model llama8b-random --engines interp --tp "$tp" \
      --conditions "${BENCH_CONDITIONS:-idle,steered,capture}" --repeats "${BENCH_REPEATS:-7}" \
      --worker-timeout $(( left - 20 )) ${TP_BENCH_ARGS:-} --json "$OUT/bench_llama8b_tp$tp.json" || rc=$?
  done
  return "$rc"
}

stage_bench() {
  local budget=$1 model=$2 engines=$3 suffix=${4:-}
  local name=${model%%_*}
  [ "$model" = llama8b-random ] && name=llama8b
  timeout -k 10 $(( budget - 5 )) $PY bench/steer_overhead.py --model "$model" --engines "$engines" \
    --conditions "${BENCH_CONDITIONS:-idle,steered,capture}" --repeats "${BENCH_REPEATS:-7}" \
    --worker-timeout $(( budget - 20 )) ${BENCH_ARGS:-} --json "$OUT/bench_${name}${suffix}.json"
}

main 2>&1 | tee -a "$OUT/check.log"
exit "${PIPESTATUS[0]}"
