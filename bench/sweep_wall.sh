#!/usr/bin/env bash
# A Hydra `-m` sweep spread over this machine's GPUs by a launcher Hydra already has, timed against the same sweep on
# one GPU. Writes OUT.json (wall seconds, each job's status and GPUs) and prints it.
#
#   bash bench/sweep_wall.sh OUT.json [override ...]      # default: SWEEP below
#
# `parallel`: hydra/launcher=parallel (joblib, n_jobs = the GPUs), or with SWEEP_LAUNCHER=local submitit's local
# executor (hydra/launcher=local: SLURM's code path; it starts every job at once and shows each the machine's first
# $GPUS GPUs, whatever CUDA_VISIBLE_DEVICES says, so give it no more jobs than GPUs and the machine's first GPUs), each job process on its own GPU
# (interp_runner.engine.job_gpus), with its own engine. `one-gpu`: Hydra's basic launcher on the first GPU given, the jobs one after another in one
# process on one engine (reused between jobs). Whole `python -m interp_runner` processes, start to end.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
JSON=${1:?usage: sweep_wall.sh OUT.json [override ...]}
shift
SWEEP=("$@")
[ ${#SWEEP[@]} -eq 0 ] && SWEEP=(+experiment=causal_trace_full causal_trace.num_facts=12 causal_trace.plots=false
                                 "causal_trace.noise.seed=0,1,2,3")
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
FIRST_GPU=${CUDA_VISIBLE_DEVICES:-0}; FIRST_GPU=${FIRST_GPU%%,*}  # the one-GPU run stays inside the GPUs it was given
ROOT=${SWEEP_DIR:-/tmp/interp-sweep-wall}
case ${SWEEP_LAUNCHER:-parallel} in  # the launcher of the spread-out variant
  parallel) LAUNCH=(hydra/launcher=parallel "hydra.launcher.n_jobs=$GPUS") ;;
  local) LAUNCH=(hydra/launcher=local "hydra.launcher.gpus_per_node=$GPUS") ;;  # starts every job at once
  *) echo "SWEEP_LAUNCHER: parallel (joblib) or local (submitit's local executor), not ${SWEEP_LAUNCHER}"; exit 2 ;;
esac
rm -rf "$ROOT"
declare -A WALL RC
for variant in ${SWEEP_VARIANTS:-parallel one-gpu}; do  # SWEEP_VARIANTS=parallel: no one-GPU run
  dir=$ROOT/$variant
  t0=$EPOCHREALTIME
  if [ "$variant" = parallel ]; then
    $PY -m interp_runner -m "${LAUNCH[@]}" "${SWEEP[@]}" "hydra.sweep.dir=$dir" > "$ROOT.$variant.log" 2>&1
  else
    CUDA_VISIBLE_DEVICES=$FIRST_GPU $PY -m interp_runner -m "${SWEEP[@]}" "hydra.sweep.dir=$dir" > "$ROOT.$variant.log" 2>&1
  fi
  RC[$variant]=$?
  WALL[$variant]=$($PY -c "print(round($EPOCHREALTIME - $t0, 2))")
  echo "$variant: rc ${RC[$variant]}, ${WALL[$variant]} s"; grep -E "^job [0-9]+: GPUs" "$ROOT.$variant.log"
done
$PY - "$JSON" "$ROOT" "$GPUS" "${WALL[parallel]}" "${RC[parallel]}" "${WALL[one-gpu]:-nan}" "${RC[one-gpu]:-0}" \
  "${SWEEP[*]}" "${SWEEP_LAUNCHER:-parallel}" <<'PY'
import json, re, sys
from pathlib import Path
out, root, gpus, wp, rp, w1, r1, sweep, launcher = sys.argv[1:]
def jobs(variant):
    index = Path(root) / variant / "sweep.json"
    return json.loads(index.read_text())["jobs"] if index.exists() else []
bound = re.findall(r"^job (\d+): GPUs (\S+)", Path(f"{root}.parallel.log").read_text(), re.M)
result = {"sweep": sweep, "gpus": int(gpus), "launcher": launcher,
          "parallel": {"wall_s": float(wp), "rc": int(rp), "jobs": [j["status"] for j in jobs("parallel")],
                       "job_gpus": {int(n): g for n, g in bound}},
          "one_gpu": {"wall_s": float(w1), "rc": int(r1), "jobs": [j["status"] for j in jobs("one-gpu")]}}
result["speedup"] = round(float(w1) / float(wp), 3)
Path(out).write_text(json.dumps(result, indent=1))
print(json.dumps(result))
PY
[ "${RC[parallel]}" = 0 ] && [ "${RC[one-gpu]:-0}" = 0 ]
