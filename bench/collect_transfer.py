"""Time of the call that takes captured values off the workers (``VllmEngine.collect``), at a tensor-parallel size.

One engine (CPU or GPU), ``--requests`` prompts that each capture ``--hooks`` at every layer and every prompt
position (``--positions all_prompt``) or the last one (``last_prompt``: many small arrays, as a large model's
capture of its last position at every layer); the requests run with ``VllmEngine.run`` ``--repeats`` times and each
run's ``collect`` call is timed. Prints the median and all times, the captured bytes and array count.

    VLLM_ENABLE_V1_MULTIPROCESSING=1 VLLM_CPU_OMP_THREADS_BIND='0|1' \\
        python bench/collect_transfer.py --model smollm2_135m --tp 2 --requests 16 --positions all_prompt
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=60)
    ap.add_argument("--hooks", default="post_block")
    ap.add_argument("--positions", default="all_prompt", choices=("all_prompt", "last_prompt"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if args.tp == 1 else "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    from interp_runner.engine.adapter import VllmEngine
    from interp_runner.engine.settings import on_gpu
    from interp_runner.pipeline import prepare

    words = " ".join(f"word{i}" for i in range(args.prompt_words))
    config = {
        "model": {"name": args.model},
        "engine": {"dtype": args.dtype, "enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 8,
                   "tensor_parallel_size": args.tp},
        "prompts": {"items": [f"Request {i}: {words}" for i in range(args.requests)]},
        "sampling": {"max_tokens": 1, "temperature": 0.0},
        "capture": [{"name": "acts", "hooks": args.hooks.split(","), "layers": "all", "positions": args.positions}],
    }
    prepared = prepare(config)
    engine = VllmEngine(str(prepared.facts.path), prepared.cfg.engine.resolved(on_gpu(), True),
                        prepared.plan.engine_spec)
    times = []
    collect = engine.collect

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = collect(*a, **kw)
        times.append(time.perf_counter() - t0)
        return out

    engine.collect = timed
    try:
        results = engine.run(prepared.plan.requests, use_tqdm=False)
        for _ in range(args.repeats):
            results = engine.run(prepared.plan.requests, use_tqdm=False)
    finally:
        engine.close()
    times = times[1:]  # the first run warms up
    arrays = sum(len(r.captures) for r in results.values())
    nbytes = sum(v.nbytes + p.nbytes for r in results.values() for p, v in r.captures.values())
    out = {"tp": args.tp, "model": args.model, "positions": args.positions, "requests": args.requests,
           "captured_mb": round(nbytes / 1e6, 2), "arrays": arrays,
           "collect_ms_median": round(1e3 * statistics.median(times), 2),
           "collect_ms": [round(1e3 * t, 2) for t in times]}
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
