#!/usr/bin/env bash
# Before/after benches of two pinned trees on one GPU machine. Each tree is a `git archive` of one commit in an
# ignored folder of the repository root (.bench-before, .bench-after); each runs its own bench/gpu_check.sh from
# inside that folder, installed into its own site folder, so its entry point and PYTHONPATH load its own code.
# Results land flat under $OUT, named by label (tree + round: before1, after2, ...); the log of every check is
# appended to $OUT/split_compare.log.
#
#   bash bench/split_compare.sh setup                           # both trees: install, models, which code loads
#   bash bench/split_compare.sh trace:before1 trace:after1      # trace grids (TRACE_REPEATS, default 5)
#   bash bench/split_compare.sh small:after1 small:before1      # SmolLM2 steering + capture (BENCH_REPEATS, 16)
#
# SPLIT_DEADLINE_S (default 580) bounds the whole command: each check gets what is left of it.
# bench/split_compare.py reads the results and pairs the two trees.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
LOG=$OUT/split_compare.log
DEADLINE=$(( SECONDS + ${SPLIT_DEADLINE_S:-580} ))

tree_of() { echo "$ROOT/.bench-$1"; }
site_of() { echo "/tmp/site-ir-$1"; }

# what a tree's processes import: its interp_runner, its plugin module through the entry point, its kernels
which_code() {
  local tree site
  tree=$(tree_of "$1"); site=$(site_of "$1")
  (
    [ -f /tmp/gpu-env.sh ] && . /tmp/gpu-env.sh
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}  # as gpu_check.sh sets it (run from the tree: its code first)
    cd "$tree" && python3 - "$1" <<'EOF'
import sys
from importlib.metadata import entry_points

ep = next(e for e in entry_points(group="vllm.general_plugins") if e.name == "interp_runner")
register = ep.load()
import interp_runner
import interp_runner_kernels
from interp_runner.payload import plugin_fingerprint

print(f"[{sys.argv[1]}] interp_runner: {interp_runner.__file__}")
print(f"[{sys.argv[1]}] entry point {ep.value}: {sys.modules[register.__module__].__file__}")
print(f"[{sys.argv[1]}] kernels: {interp_runner_kernels.__file__}")
print(f"[{sys.argv[1]}] plugin fingerprint: {plugin_fingerprint()}")
EOF
  )
}

# one tree's gpu_check.sh stages, its results copied to $OUT under the label
check() {
  local label=$1; shift
  local tree=${label%%[0-9]*}
  local scratch=/tmp/split-compare/$label left=$(( DEADLINE - SECONDS ))
  rm -rf "$scratch" && mkdir -p "$scratch"
  echo "=== $label: $* ($(date -u +%H:%M:%S), ${left}s left)"
  OUT=$scratch INTERP_SITE=$(site_of "$tree") GPU_CHECK_BUDGET_S=$(( left - 5 )) BENCH_ENGINES=interp \
    BENCH_REPEATS=${BENCH_REPEATS:-16} BENCH_SUFFIX=_$label TRACE_REPEATS=${TRACE_REPEATS:-5} \
    TRACE_JSON=trace_grid_$label bash "$(tree_of "$tree")/bench/gpu_check.sh" "$@"
  local rc=$?
  cp "$scratch"/bench_*.json "$scratch"/trace_grid_*.json "$OUT/" 2>/dev/null
  return $rc
}

main() {
  local failed=0
  for job in "$@"; do
    case $job in
      setup) for t in before after; do
               check "$t" setup || failed=1
               which_code "$t" || failed=1
             done ;;
      trace:*) check "${job#trace:}" bench-trace || failed=1 ;;
      small:*) check "${job#small:}" bench-small || failed=1 ;;
      *) echo "unknown job $job"; failed=1 ;;
    esac
  done
  return $failed
}

main "$@" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
