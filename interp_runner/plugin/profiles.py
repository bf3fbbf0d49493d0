"""Where a worker's time goes, for benchmarks, over a span of steps: the device's (``DeviceProfile``,
``torch.profiler``, summed by kernel) and the host's (``HostProfile``, ``cProfile`` of the worker's thread, summed by
function, with the garbage collector's passes).

Started and stopped by the worker extension (``interp_profile_start`` / ``interp_profile_stop``, with ``kind``
``device`` or ``host``): offline through ``LLM.collective_rpc``, on a server through vLLM's dev route ``POST
/collective_rpc``, so a served engine is profiled in its own processes. Where the engine core runs its worker in its
own thread (vLLM's one-process executor), the host profile holds the scheduler's work too. What comes back is small:
per name its calls and milliseconds.
"""

from __future__ import annotations

import time

# host calls that wait for the device; copies from pageable host memory wait for the stream too
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaStreamWaitEvent")


def summarize(prof) -> dict:
    """A finished profile: device milliseconds and calls in all, per name (``all``: [calls, ms]), and the waits
    (``waits``: [calls, host ms]). Device time is the device's own events' (kernels, copies, sets), not again the
    host ops' that launched them; on a CPU engine, where there are none, the host ops' own CPU time stands in."""
    from torch.autograd import DeviceType

    device: dict[str, list] = {}
    host: dict[str, list] = {}
    waits: dict[str, list] = {}
    for event in prof.key_averages():
        own = getattr(event, "self_device_time_total", 0.0)
        if own > 0 and event.device_type != DeviceType.CPU:
            device[event.key] = [event.count, own / 1e3]
        elif event.device_type == DeviceType.CPU and event.self_cpu_time_total > 0:
            host[event.key] = [event.count, event.self_cpu_time_total / 1e3]
        if event.key in SYNC_CALLS or "Pageable" in event.key:
            waits[event.key] = [event.count, event.cpu_time_total / 1e3]
    spent = device or host
    return {"device_ms": sum(ms for _, ms in spent.values()), "device_calls": sum(n for n, _ in spent.values()),
            "measured": "device" if device else "host", "all": spent, "waits": waits}


class DeviceProfile:
    """A running profile of this process's device work (and its host ops), from construction to ``stop``."""

    def __init__(self):
        import torch
        from torch.profiler import ProfilerActivity, profile

        self._cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        self._prof = profile(activities=activities)
        self._prof.__enter__()

    def stop(self) -> dict:
        """The profile so far, summed (``summarize``); the profiler stops."""
        import torch

        if self._cuda:
            torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        return summarize(self._prof)


class HostProfile:
    """A running ``cProfile`` of the calling thread, and the garbage collector's passes and time in this process, from
    construction to ``stop``."""

    TOP = 400  # functions kept, by their own time

    def __init__(self):
        import cProfile
        import gc

        self._gc = {"passes": 0, "s": 0.0}
        self._started: list[float] = []
        gc.callbacks.append(self._on_gc)
        self._prof = cProfile.Profile()
        self._prof.enable()

    def _on_gc(self, phase, _info) -> None:
        if phase == "start":
            self._started.append(time.perf_counter())
        elif self._started:
            self._gc["passes"] += 1
            self._gc["s"] += time.perf_counter() - self._started.pop()

    def stop(self) -> dict:
        """Per function (``path:line name``, the ``TOP`` largest by own time): [calls, own ms, cumulative ms]; the
        collector's passes and ms."""
        import gc
        import pstats

        self._prof.disable()
        gc.callbacks.remove(self._on_gc)
        funcs = {}
        for (path, line, name), (_, calls, own, cum, _) in pstats.Stats(self._prof).stats.items():
            short = path.rsplit("site-packages/", 1)[-1]
            funcs[f"{short}:{line} {name}"] = [calls, 1e3 * own, 1e3 * cum]
        top = dict(sorted(funcs.items(), key=lambda kv: -kv[1][1])[: self.TOP])
        return {"gc_passes": self._gc["passes"], "gc_ms": 1e3 * self._gc["s"], "funcs": top}


KINDS = {"device": DeviceProfile, "host": HostProfile}
