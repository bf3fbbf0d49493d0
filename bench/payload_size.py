"""Payload size and plan compile time of an experiment, compiled only (no engine starts).

Compiles the plan of an experiment (default ``+experiment=causal_trace_full``) ``--repeats`` times and reports the
median compile time (``pipeline.prepare``, as ``interp-run`` times it; it compiles with the heap's collector off), wall and
CPU seconds of this process (on a shared machine the CPU time is the steadier of the two), then measures
what the requests' payloads weigh as vLLM carries them between processes: each request's ``SamplingParams``
(``EngineRequest.sampling_params``) and its ``extra_args`` encoded with vLLM's own ``MsgpackEncoder`` (the encoder
of its engine-core requests), the bytes of every buffer it returns summed. The cells of the plan are also packed as
the bulk path packs them on a GPU (``packing.group_cells``: 16-token blocks, the experiment's batched tokens) and
the packed requests measured the same way.

    python bench/payload_size.py --repeats 5 -- +experiment=causal_trace_full
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def config_of(overrides: list[str]) -> dict:
    import interp_runner.cli  # noqa: F401  (registers the config resolvers)
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        return OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)


def compile_once(config: dict):
    from interp_runner.pipeline import prepare

    t0, c0 = time.perf_counter(), time.process_time()
    prepared = prepare(config, base=REPO)
    return prepared, time.perf_counter() - t0, time.process_time() - c0


def transported_bytes(sampling_params, encoder) -> int:
    extra = sampling_params.extra_args
    return 0 if extra is None else sum(len(buf) for buf in encoder.encode(extra))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16, help="KV block of the packed requests (GPU: 16)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", default=None, help="config overrides (after --)")
    args = ap.parse_args()
    overrides = args.overrides or ["+experiment=causal_trace_full"]
    config = config_of(overrides)
    times, cpu, prepared = [], [], None
    for _ in range(args.repeats):
        prepared = None
        gc.collect()
        prepared, seconds, cpu_seconds = compile_once(config)
        times.append(seconds)
        cpu.append(cpu_seconds)
    plan = prepared.plan

    from vllm import SamplingParams
    from vllm.v1.serial_utils import MsgpackEncoder

    from interp_runner.compile.packing import group_cells

    encoder = MsgpackEncoder()
    requests = plan.requests
    total = sum(transported_bytes(r.sampling_params(), encoder) for r in requests)
    limit = min(prepared.cfg.engine.max_model_len - 1, prepared.cfg.engine.max_num_batched_tokens or 8192)
    groups, single = group_cells(requests, args.block_size, limit)
    packed = [g.request() for g in groups]
    packed_total = sum(transported_bytes(SamplingParams(**p.sampling), encoder) for p in packed)
    packed_total += sum(transported_bytes(r.sampling_params(), encoder) for r in single)
    row = {
        "overrides": overrides,
        "requests": len(requests),
        "compile_s_median": round(statistics.median(times), 3),
        "compile_s": [round(t, 3) for t in times],
        "compile_cpu_s_median": round(statistics.median(cpu), 3),
        "compile_cpu_s": [round(t, 3) for t in cpu],
        "payload_bytes": total,
        "payload_bytes_per_request": round(total / max(len(requests), 1), 1),
        "packed_requests": len(packed) + len(single),
        "packed_payload_bytes": packed_total,
    }
    print(json.dumps(row, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
