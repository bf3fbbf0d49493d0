"""Host time of the plugin's step planner in a serving-like sequence of steps, on the CPU: SmolLM2-135M's shape (30
layers, hidden 576), 64 requests in flight, one finishing every ``--every`` steps and a new one with a 512-token
prompt arriving, prefilled in chunks of 200 tokens beside the others' decodes. Every step plans a changed batch.

Conditions: ``plain`` (no payloads), ``steer`` (every request steered at post_block of every layer, one of 4
vectors), ``capture4`` (every request captures its last prompt position at 4 layers). Per condition, µs a step of
``before_forward`` + ``after_forward`` (``planner``) and of ``plan_sequences`` (``seq``, called first each step by the
runners), median and mean, for decode-only steps and steps with a prompt chunk; of the ops at all 30 sites in a
decode step run outside CUDA graphs (``ops decode``: on the CPU, their adds' own work included); and of the read-back
of a finished request's results (``collect``, between steps). Uploads go through a staging ring (``staging.PinnedRing``) as on a
GPU, here in plain host memory (``--no-ring``: plain copies, as on a CPU).

    python bench/planner_steps.py                   # about 20 s
    python bench/planner_steps.py --check           # a digest of every step's buffers and of the rank checksum
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS
from unittest import mock

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the planner's stand-ins (runner view, worker-side requests)

import torch  # noqa: E402
import vllm.distributed  # noqa: E402

from interp_runner.contracts import DECODE, PREFILL, Capture, RequestPayload, Steer  # noqa: E402
from interp_runner.payload import pack_positions  # noqa: E402
from interp_runner.plugin.runtime import InterpState  # noqa: E402
from interp_runner.plugin.staging import STAGING_BYTES, PinnedRing  # noqa: E402
from interp_runner.sites import site_id  # noqa: E402
from support import planner as stand_in  # noqa: E402

LAYERS, HIDDEN, LIVE, PROMPT, CHUNK, OUTPUT = 30, 576, 64, 512, 200, 128
SITES = [site_id(layer, "post_block") for layer in range(LAYERS)]
CAPTURED = tuple(SITES[i] for i in (0, 10, 20, 29))


def make_state(ranks: int, ring: bool) -> InterpState:
    cfg = NS(model_config=NS(hf_text_config=NS(hidden_size=HIDDEN), dtype=torch.float32),
             scheduler_config=NS(max_num_batched_tokens=2048, max_num_seqs=LIVE), parallel_config=NS(world_size=ranks))
    staging = PinnedRing(STAGING_BYTES if ring else 0, torch.device("cpu"), synchronize=lambda: None)
    with mock.patch.object(vllm.distributed, "get_tensor_model_parallel_rank", lambda: 0), \
            mock.patch.object(PinnedRing, "for_device", lambda device: staging):
        state = InterpState(cfg, {"plugin": "bench", "steer_sites": SITES, "capture_sites": SITES})
    rng = np.random.default_rng(0)
    state.register_vectors({f"v{k}": rng.standard_normal(HIDDEN).astype(np.float32).tobytes() for k in range(4)})
    return state


def payload(condition: str, rid: str, k: int) -> RequestPayload | None:
    if condition == "steer":
        return RequestPayload(rid, steer=tuple(Steer(s, PREFILL | DECODE, f"v{k % 4}", 0.5) for s in SITES))
    if condition == "capture4":
        return RequestPayload(rid, capture=(Capture(CAPTURED, pack_positions([PROMPT - 1]), False),))
    return None


def steps(count: int, every: int, seed: int = 0):
    """Per step: its (request id, first position, rows) in batch order (a leaving request's place taken by the
    last, as vLLM's V1 batch condenses; a new one appended), and the request that left before it (or None)."""
    rng = np.random.default_rng(seed)
    batch = [[f"r{i}", PROMPT + int(rng.integers(OUTPUT))] for i in range(LIVE)]  # request id, tokens computed
    made = LIVE
    for index in range(count):
        gone = None
        if index % every == 0:
            at = int(rng.integers(len(batch)))
            gone, batch[at] = batch[at][0], batch[-1]
            batch.pop()
            batch.append([f"r{made}", 0])
            made += 1
        step = [(rid, done, min(CHUNK, PROMPT - done) if done < PROMPT else 1) for rid, done in batch]
        for entry, (_, _, rows) in zip(batch, step):
            entry[1] += rows
        yield step, gone


def buffers_digest(state: InterpState, rows: int) -> bytes:
    """What the ops read this step: each row's steering and flag slots, the capture rows and counts."""
    cap = state.capture
    parts = [state.steering.row_slot[:rows], state.result_flags.row_slot[:rows], cap.cap_count]
    for k, c in enumerate(cap.cap_count.tolist()):
        parts += [cap.cap_src[k, :c], cap.cap_dest[k, :c]]
    return b"".join(p.numpy().tobytes() for p in parts)


def run(condition: str, count: int, warm: int, every: int, check: bool, ring: bool = True) -> dict:
    """µs per step (``decode``, ``chunk``, their ``seq``) and per read-back (``collect``); with ``check``, a digest."""
    state = make_state(2 if check else 1, ring)
    requests, seen, results = {}, [], {}  # the live requests, every request, their results as read back
    times = {key: [] for key in ("decode", "chunk", "seq decode", "seq chunk", "ops decode", "collect")}
    digest = hashlib.blake2b(digest_size=8)
    clock = time.perf_counter_ns
    for index, (step, gone) in enumerate(steps(warm + count, every)):
        timed = index >= warm
        if gone is not None:  # its results read back, as a server does once it finished
            t0 = clock()
            state.finished([gone])
            results.update(state.collect([gone]))
            requests.pop(gone, None)
            if timed:
                times["collect"].append((clock() - t0) / 1e3)
        for rid, _, _ in step:
            if rid not in requests:
                requests[rid] = stand_in.request(payload(condition, rid, int(rid[1:])), PROMPT)
                seen.append(rid)
        view = stand_in.runner(requests, step)
        rows = sum(r for _, _, r in step)
        t0 = clock()
        state.plan_sequences(view)
        t1 = clock()
        state.before_forward(view, rows)
        t2 = clock()
        if timed and rows == len(step):  # the ops of a decode step run outside CUDA graphs, every site
            x = torch.zeros(rows, HIDDEN)
            t3 = clock()
            for site in SITES:
                state.apply_site(x, None, site)
            times["ops decode"].append((clock() - t3) / 1e3)
        t4 = clock()
        state.after_forward()
        t2 += clock() - t4
        if check:
            digest.update(buffers_digest(state, rows))
        if timed:
            kind = "decode" if rows == len(step) else "chunk"
            times[kind].append((t2 - t1) / 1e3)
            times["seq " + kind].append((t1 - t0) / 1e3)
    if check:  # and what the requests' results hold
        results.update(state.collect([r for r in seen if r not in results]))
        for rid, result in sorted(results.items()):
            digest.update(f"{rid} {result['nonfinite']} {result['void']}".encode())
            for site, (positions, values) in sorted(result["captures"].items()):
                digest.update(f"{rid} {site} {positions.tolist()} {values.shape}".encode())
        times["digest"] = digest.hexdigest() + " " + state.checksum()["digest"][:16]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conditions", default="plain,steer,capture4")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--warm", type=int, default=40)
    parser.add_argument("--every", type=int, default=4, help="steps between a request leaving and one arriving")
    parser.add_argument("--check", action="store_true", help="print digests of the buffers and the checksum")
    parser.add_argument("--no-ring", action="store_true", help="plain copies, as a CPU engine makes them")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'condition':<10} {'µs of':>10} {'n':>5} {'median':>8} {'mean':>8}")
    for condition in args.conditions.split(","):
        out = run(condition, args.steps, args.warm, args.every, args.check, not args.no_ring)
        digest = out.pop("digest", None)
        for key, values in out.items():
            print(f"{condition:<10} {key:>10} {len(values):>5} {statistics.median(values):>8.1f} "
                  f"{statistics.fmean(values):>8.1f}")
        if digest:
            print(f"{condition:<10} digest {digest}")


if __name__ == "__main__":
    main()
