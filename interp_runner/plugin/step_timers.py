"""Host time of a worker's calls, call by call, for benchmarks: the plugin's planning before each forward
(``planner``), its work after it, its read-backs, its ops' work in steps run outside CUDA graphs (``site_ops``), and
the model runner's ``execute_model`` and ``sample_tokens``.

Started and stopped by the worker extension (``interp_timers_start`` / ``interp_timers_stop``): offline through
``LLM.collective_rpc``, on a server through vLLM's dev route ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``),
so TP workers' own processes are timed too. The wrappers go once stopped.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

# ``site_ops``: the ops' work at their sites in steps run outside CUDA graphs (a graph's replay calls no Python)
STATE_CALLS = {"planner": "before_forward", "after_forward": "after_forward", "collect": "collect",
               "site_ops": "apply_site"}
RUNNER_CALLS = ("execute_model", "sample_tokens")


class StepTimers:
    """Wraps the timed calls now (``state_class``: the plugin state's, ``InterpState``); ``stop`` unwraps them and
    sums each up."""

    def __init__(self, runner, state_class: type, results_module=None):
        self.spent: dict[str, list[float]] = defaultdict(list)
        self._patched: list[tuple[object, str, object | None]] = []
        for key, name in STATE_CALLS.items():
            self._time(state_class, name, key)
        if results_module is not None:  # the worker module's ``send_results``: what packs a read-back's results
            self._time(results_module, "send_results", "send_results")
        for name in RUNNER_CALLS:
            self._time(runner, name, name)

    def _time(self, owner, name: str, key: str) -> None:
        original = getattr(owner, name)
        own = name in vars(owner)  # else an instance's attribute shadows its class's method until unwrapped
        spent = self.spent[key]

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - t0)

        self._patched.append((owner, name, original if own else None))
        setattr(owner, name, timed)

    def stop(self) -> dict[str, dict[str, float]]:
        """Per call kind: calls, mean / median / max microseconds, total milliseconds (kinds never called left out)."""
        for owner, name, original in reversed(self._patched):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._patched = []
        return {key: {"steps": len(values), "mean_us": 1e6 * statistics.fmean(values),
                      "median_us": 1e6 * statistics.median(values), "max_us": 1e6 * max(values),
                      "total_ms": 1e3 * sum(values)}
                for key, values in self.spent.items() if values}
