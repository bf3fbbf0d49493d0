"""Whether an unsteered request gives the numbers of an engine without interp ops: greedy tokens and their
log-probabilities from an engine with steering and capture ops at ``post_block`` of every layer (``--hook``,
``--layers``; no request steered or captured), against the same engine built with no sites (the model's own graph). Each engine runs in a
process of its own; the worst log-probability difference and whether every token matches are printed last.

    python bench/unsteered_parity.py --model smollm2_135m --dtype bfloat16          # compiled (torch.compile)
    python bench/unsteered_parity.py --model smollm2_135m --dtype bfloat16 --eager

On a CPU, set ``VLLM_DISABLE_COMPILE_CACHE=1`` so that each engine compiles its own graph.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PROMPTS = ["The Eiffel Tower is located in", "The history of bread begins", "In 1969, the first person to walk on",
           "The chemical symbol for gold is", "A lighthouse keeper's day starts", "The capital of Japan is"]


def generate(args) -> list[list[tuple[int, float]]]:
    """(token, log-probability) of each prompt's greedy tokens, on an engine with or without the sites."""
    from vllm import SamplingParams

    from interp_runner.config.schema import EngineConfig
    from interp_runner.engine.adapter import VllmEngine
    from interp_runner.models.facts import ModelFacts
    from interp_runner.models.materialize import model_path
    from interp_runner.payload import EngineSpec
    from interp_runner.sites import site_id

    path = model_path(args.model)
    layers = ModelFacts.from_folder(path).num_layers
    chosen = range(layers) if args.layers == "all" else [int(x) for x in args.layers.split(",") if x]
    sites = tuple(site_id(layer, args.hook) for layer in chosen) if args.side == "sites" else ()
    settings = {"dtype": args.dtype, "enforce_eager": args.eager, "max_model_len": 1024, "max_num_seqs": 8}
    if args.kv_cache_bytes:
        settings["kv_cache_memory_bytes"] = args.kv_cache_bytes
    engine = VllmEngine(str(path), EngineConfig(**settings), EngineSpec(sites, sites, (), 0, 0, 0))
    try:
        outs = engine.llm.generate(PROMPTS, SamplingParams(max_tokens=args.max_tokens, temperature=0, logprobs=0),
                                   use_tqdm=False)
    finally:
        engine.close()
    return [[(t, float(lp[t].logprob)) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            for o in outs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (default: torch.compile)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--layers", default="all", help="the layers with sites: all, or a comma list (a bisection; empty: none, the two engines' own noise)")
    ap.add_argument("--hook", default="post_block", help="the sites' hook")
    ap.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="0: vLLM's default")
    ap.add_argument("--side", choices=("sites", "none"), help=argparse.SUPPRESS)  # one engine's run, in a child
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side:
        args.out.write_text(json.dumps(generate(args)))
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("none", "sites"):
            out = Path(tmp) / f"{side}.json"
            subprocess.run([sys.executable, __file__, *(argv or sys.argv[1:]), "--side", side, "--out", str(out)],
                           check=True)
            results[side] = json.loads(out.read_text())
    pairs = [(a, b) for x, y in zip(results["none"], results["sites"]) for a, b in zip(x, y)]
    same_tokens = all(a[0] == b[0] for a, b in pairs)
    worst = max(abs(a[1] - b[1]) for a, b in pairs)
    print(f"{len(PROMPTS)} prompts x {args.max_tokens} tokens, {args.dtype}, {'eager' if args.eager else 'compiled'}: "
          f"tokens {'all equal' if same_tokens else 'DIFFER'}, worst log-probability difference {worst:.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
