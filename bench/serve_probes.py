"""What ``bench/serve_bench.py`` does to a server outside its timed intervals: start it and wait for it, and the two
probes of one request each (the response's size with a capture, the TTFT of a freshly registered vector)."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from steer_profile import largest_changes

REPO = Path(__file__).resolve().parent.parent


def launch(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=str(REPO))


def wait_up(proc: subprocess.Popen, port: int, log: Path, timeout_s: float = 900) -> subprocess.Popen:
    """``proc`` once its server answers /health."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited {proc.returncode}; see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit(f"{proc.args[0]} did not start; see {log}")


def start_servers(servers: list[tuple[list[str], int, Path]], env: dict, at_once: bool) -> list[subprocess.Popen]:
    """Each (command, port, log) started and answering; ``at_once``, all launched before any is waited for (KV caches
    of a fixed size), else one after the other (vLLM sizes a KV cache from the GPU's free memory, which another
    server's start would move). A server that fails stops those already launched."""
    procs: list[subprocess.Popen] = []
    try:
        for cmd, port, log in servers:
            procs.append(launch(cmd, log, env))
            if not at_once:
                wait_up(procs[-1], port, log)
        if at_once:
            for proc, (_, port, log) in zip(procs, servers):
                wait_up(proc, port, log)
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    return procs


def capture_body(layers: int) -> dict:
    chosen = sorted({0, layers // 3, 2 * layers // 3, layers - 1})
    return {"interp": {"capture": {"layers": chosen, "positions": "last_prompt"}}}


def response_bytes(port: int, layers: int) -> dict:
    """Bytes of one completion's response body, plain and with ``capture4``'s capture."""
    sizes = {}
    for name, extra in (("plain", {}), ("capture4", capture_body(layers))):
        body = json.dumps({"model": "served", "prompt": "The history of bread begins", "max_tokens": 16,
                           "temperature": 0, **extra}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            sizes[name] = len(urllib.request.urlopen(request, timeout=60).read())
        except urllib.error.HTTPError as e:  # capture4's layers outside a narrowed serve.sites
            sizes[name] = f"refused: HTTP {e.code}"
    return sizes


def fresh_vector_ttft(port: int, name: str, hidden: int, repeats: int) -> dict:
    """TTFT (ms) of a streamed one-token request steered with a vector registered just before it, with one
    registered long before, and unsteered: interleaved, ``repeats`` of each, after one untimed round."""
    import numpy as np
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    rng = np.random.default_rng(0)

    def register(vector_name: str) -> None:
        body = json.dumps({"name": vector_name, "values": rng.standard_normal(hidden).tolist(),
                           "replace": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/interp/vectors", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=60).read()

    def ttft(vector_name: str | None) -> float:
        extra = None if vector_name is None else {"interp": {"steering": {"base": {"post_block": {
            "layer": 0, "vector": vector_name}}}}}
        t0 = time.perf_counter()
        stream = client.completions.create(model=name, prompt="The history of bread begins", max_tokens=1,
                                           stream=True, extra_body=extra)
        next(iter(stream))
        elapsed = time.perf_counter() - t0
        stream.close()
        return 1e3 * elapsed

    register("old")
    register("warm")  # one untimed round: the server's first streamed requests are not a fresh vector's cost
    for vector_name in ("warm", "old", None):
        ttft(vector_name)
    times: dict[str, list[float]] = {"fresh": [], "registered": [], "unsteered": []}
    for i in range(repeats):
        register(f"fresh{i}")
        times["fresh"].append(ttft(f"fresh{i}"))
        times["registered"].append(ttft("old"))
        times["unsteered"].append(ttft(None))
    return {k: {"median_ms": statistics.median(v), "max_ms": max(v)} for k, v in times.items()}


def worker_call(port: int, method: str, args: list | None = None) -> list:
    """A worker extension's method on the server's workers, through vLLM's dev route ``/collective_rpc``: each
    rank's answer. ``interp_timers_start`` / ``_stop``: the host time of the plugin's and the runner's calls per step
    (``interp_runner.plugin.step_timers``); ``interp_profile_start`` / ``_stop``: a profile (``plugin.profiles``)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/collective_rpc", method="POST",
                                     data=json.dumps({"method": method, "args": args or []}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        body = response.read()
    return json.loads(body)["results"] if body else []


def profile_table(kind: str, profiles: dict) -> str:
    """Per condition's profiled interval: its steps, and device milliseconds a step (``device``: by kernel) or the
    collector's passes (``host``: own time by function); then, against the first condition, the names whose time a
    step changed most."""
    table = "all" if kind == "device" else "funcs"  # [calls, ms] by kernel; [calls, own ms, cumulative ms] by function
    lines = [f"{kind} profile (one more interp interval each, in the server's workers):"]
    for condition, p in profiles.items():
        head = f"  {condition:<16}{p['steps']:>6.0f} steps, "
        steps = max(p["steps"], 1)
        if kind == "device":
            waits = ", ".join(f"{k} {n} / {ms:.1f}" for k, (n, ms) in p.get("waits", {}).items()) or "none"
            lines.append(f"{head}{p['device_ms'] / steps:8.3f} {p['measured']} ms a step; "
                         f"waits (calls, host ms): {waits}")
        else:
            own = sum(f[1] for f in p["funcs"].values()) / steps
            lines.append(f"{head}{own:8.3f} host ms a step in its largest functions; gc {p['gc_passes']} passes, "
                         f"{p['gc_ms']:.1f} ms")

    def per_step(prof) -> dict:
        steps = max(prof["steps"], 1)
        return {name: [row[0] / steps, 1e3 * row[1] / steps] for name, row in prof[table].items()}

    (first, base), *others = profiles.items()
    for condition, p in others:
        for name, (c0, us0), (c1, us1) in largest_changes(per_step(base), per_step(p), 12):
            lines.append(f"  {condition} vs {first}: {us1 - us0:+8.1f} µs a step ({c0:.2f} -> {c1:.2f} calls) "
                         f"{name[:90]}")
    return "\n".join(lines)
