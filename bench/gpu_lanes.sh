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
#
# A lane may run another tree's check (GPU_CHECK=its gpu_check.sh, with INTERP_SITE, INTERP_RUNNER_CACHE and TMPDIR of
# its own so that the two installs, model caches and bench scratch folders stay apart): an earlier version against
# this one, in one call and on one host. The earlier tree goes along as an ignored folder, carried to the GPU
# machine:
#
#   git archive REF --prefix=.before/ | tar -x && echo /.before/ >> .git/info/exclude
#   B="GPU_CHECK=.before/bench/gpu_check.sh INTERP_SITE=/tmp/b/site INTERP_RUNNER_CACHE=/tmp/b/cache TMPDIR=/tmp/b/tmp"
#   bash bench/gpu_lanes.sh 560 "0|$B|setup bench-small bench-trace" "1||bench-small bench-trace"
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
    [ -n "${TMPDIR:-}" ] && mkdir -p "$TMPDIR"
    bash "${GPU_CHECK:-bench/gpu_check.sh}" $stages > /dev/null 2>&1
  ) &
  i=$(( i + 1 ))
done
wait
lanes=$(cd "$OUT" && ls -d l[0-9]* 2>/dev/null)
for d in $lanes; do echo "## lane ${d#l}"; cat "$OUT/$d/summary.txt" 2>/dev/null; done > "$OUT/summary.txt"
tar czf "$OUT/lanes.tgz" -C "$OUT" $lanes && (cd "$OUT" && rm -rf $lanes)
cat "$OUT/summary.txt"
