#!/usr/bin/env bash
# Several bench/gpu_check.sh runs side by side on one machine's GPUs, each lane on its own GPUs, all ending by a
# deadline; for a call under the device's 10-minute limit. Usage:
#
#   bash bench/gpu_lanes.sh SECONDS "GPUS|VAR=VALUE ...|STAGES" ...
#
# SECONDS: every lane's budget ends this many seconds after the script started. A lane: the GPUs it sees
# (CUDA_VISIBLE_DEVICES), variables for its gpu_check.sh (quoted values may hold spaces), and its stages, e.g.
#
#   bash bench/gpu_lanes.sh 560 "0|RUNNER_ONLY='v2:gpu v2:serve'|runners" "1|SERVE_ARGS='--rounds 6'|serve-bench" \
#       "2,3||tp bench-tp"
#
# Lane N writes under $OUT/lN (default ./gpu-out/lN); the lanes' summaries are gathered into $OUT/summary.txt and
# printed, and everything the lanes wrote is packed into $OUT/lanes.tgz (a device call returns few files).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
[ -f /tmp/gpu-env.sh ] && . /tmp/gpu-env.sh
deadline=$(( $(date +%s) + $1 ))
shift
i=0
for lane in "$@"; do
  IFS='|' read -r gpus vars stages <<< "$lane"
  (
    eval "export CUDA_VISIBLE_DEVICES=$gpus OUT=$OUT/l$i GPU_CHECK_BUDGET_S=$(( deadline - $(date +%s) )) $vars"
    bash bench/gpu_check.sh $stages > /dev/null 2>&1
  ) &
  i=$(( i + 1 ))
done
wait
lanes=$(cd "$OUT" && ls -d l[0-9]* 2>/dev/null)
for d in $lanes; do echo "## lane ${d#l}"; cat "$OUT/$d/summary.txt" 2>/dev/null; done > "$OUT/summary.txt"
tar czf "$OUT/lanes.tgz" -C "$OUT" $lanes && (cd "$OUT" && rm -rf $lanes)
cat "$OUT/summary.txt"
