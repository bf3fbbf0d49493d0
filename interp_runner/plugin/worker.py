"""The worker extension: methods vLLM mixes into its workers, which the runner calls through ``collective_rpc``.

vLLM loads it by ``interp_runner.engine.settings.WORKER_EXTENSION``.
"""

from __future__ import annotations

import sys

from interp_runner.plugin import profiles
from interp_runner.plugin.ops import deactivate
from interp_runner.plugin.runner_patches import plans_steps, state_of, view_of
from interp_runner.plugin.runners.base import room_name
from interp_runner.plugin.step_timers import StepTimers
from interp_runner.result_transfer import out_block, send_results


class InterpWorkerExtension:
    """Methods vLLM mixes into its workers; the runner calls them through ``collective_rpc``."""

    def _interp(self):
        state = state_of(self.model_runner)
        if state is None:
            raise RuntimeError("this engine was built without interp ops")
        return state

    def interp_status(self) -> dict:
        state = state_of(self.model_runner)
        if state is None:
            return {"loaded": False}
        return {
            "loaded": True,
            # the planner lives in the patched runner's _model_forward: any other runner would never plan a step
            "runner_planned": plans_steps(self.model_runner),
            "model_runner": room_name(self.model_runner),  # the runner vLLM picked: "v1" | "v2"
            "plugin": state.fingerprint,
            "instrumented_layers": sorted(state.instrumented_layers),
            "steer_sites": list(state.steer_sites),
            "capture_sites": list(state.capture_sites),
            "patch_sites": list(state.patch_sites),
            "bank_rows": state.patch_bank.values.shape[0] - 1,
            "kv_blocks": 0 if state.kept_kv.values is None else state.kept_kv.values.shape[1],
            "reused_kv_rows": state.packing.reused_rows,
            "result_rank": state.is_result_rank,
        }

    def interp_release(self) -> None:
        """The engine is closing: its state stops being the process's active one, so that it ends with the engine
        (its buffers freed now, not in the middle of the next engine's start)."""
        state = state_of(self.model_runner)
        if state is not None:
            deactivate(state)

    def interp_register_vectors(self, vectors: dict[str, bytes]) -> int:
        return self._interp().register_vectors(vectors)

    def interp_register_sources(self, sources: dict[str, bytes]) -> int:
        state = self._interp()
        state.forget_finished(view_of(self.model_runner).live_requests())
        return state.register_sources(sources)

    def interp_release_sources(self, keys: list[str]) -> int:
        state = self._interp()
        state.forget_finished(view_of(self.model_runner).live_requests())
        return state.release_sources(keys)

    def interp_checksum(self) -> dict:
        return self._interp().checksum()

    def _finished_here(self, rids: list[str]):
        """The plugin state once ``rids`` are marked finished on this rank; None on a rank other than the result
        rank (it keeps no results)."""
        state = self._interp()
        state.finished(rids)
        return state if state.is_result_rank else None

    def interp_collect(self, rids: list[str], packed: bool = True, carriers: list[str] = (),
                       block: str = "") -> dict | bytes | None:
        """Results of finished requests (None from ranks other than the result rank). ``packed``, for callers in
        another process: the ``result_transfer`` record, its arrays written into the caller's ``block`` where this
        worker can open it. ``carriers``: finished engine requests that carried some of them (packed cells), whose
        hold on the bank ends too."""
        state = self._finished_here([*rids, *carriers])
        if state is None:
            return None
        if not packed:
            return state.collect(rids)
        with out_block(block) as out:  # the captured rows go from the device straight into the host's block
            return send_results(state.collect(rids, out.reserve), out)

    def interp_collect_each(self, rids: list[str]) -> dict[str, bytes] | None:
        """Results of finished requests, each request's as a ``result_transfer`` record of its own, its arrays carried
        in it (None from ranks other than the result rank): a served engine's engine core sends each with its
        request's last output (``plugin.served_results``)."""
        state = self._finished_here(rids)
        if state is None:
            return None
        return {rid: send_results({rid: result}, "") for rid, result in state.collect(rids).items()}

    def interp_timers_start(self) -> None:
        """A benchmark's probe: time the plugin's and the runner's calls from now on (``plugin.step_timers``)."""
        if getattr(self, "_interp_timers", None) is None:
            self._interp_timers = StepTimers(self.model_runner, type(self._interp()), sys.modules[__name__])

    def interp_timers_stop(self) -> dict:
        """The calls timed since ``interp_timers_start`` (none: ``{}``), their wrappers removed."""
        timers, self._interp_timers = getattr(self, "_interp_timers", None), None
        return {} if timers is None else timers.stop()

    def interp_profile_start(self, kind: str = "device") -> None:
        """A benchmark's probe: profile this worker's ``device`` or ``host`` work from now on (``plugin.profiles``)."""
        if getattr(self, "_interp_profile", None) is None:
            self._interp_profile = profiles.KINDS[kind]()

    def interp_profile_stop(self) -> dict:
        """The work since ``interp_profile_start``, summed by name (none started: ``{}``); the profiler stops."""
        profile, self._interp_profile = getattr(self, "_interp_profile", None), None
        return {} if profile is None else profile.stop()
