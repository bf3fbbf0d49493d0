"""Engine-side state of the interp ops: the components that own the persistent buffers, request admission and the
per-step planner.

Every buffer the ops read is allocated once, when the model is built, so CUDA graphs captured at start-up keep
pointing at them; each step only rewrites their contents. Each buffer has one owner, which also plans its part of
a step:

- ``steering.SteeringTable``: registered vectors, ``table[site, slot]`` and each row's slot;
- ``bank.PatchBank``: patch source values (registered, or kept from a step that computes them) and kept streams;
- ``kept_kv.KeptKV``: runs' prompt KV, kept for the packed cells that reuse it;
- ``patches.PatchRows``: the bank row and coefficients of the patch at each row of a patch site;
- ``capture.CaptureBuffer``: the rows each capture site copies out, for the host or into the bank;
- ``readback.Readback``: scores and captured rows held on the device, read back in bulk; per-request results;
- ``sequences.PackedSequences``: packed cells' attention sequences, and the rows of a step that skips layers;
- ``nonfinite.ResultFlags``: each row's request, and the requests computed through a non-finite value;
- ``checksum.RankChecksum``: what this rank applied, folded by every component (the runner compares ranks);
- ``staging.PinnedRing``: host arrays to the device without a wait.

``InterpState`` composes them: it admits each new request (its payload becomes a ``records.RequestPlan``, each
component taking its part), releases finished ones, and calls the components in order each step with the batch's
plans (``batch_plans.BatchPlans``, made once per batch: the same requests in the same order reuse it). It reads the
model runner only through a ``runner_view.RunnerView``; the runner's patches are in ``runner_patches``, the worker
extension in ``worker`` (re-exported here: vLLM loads it by this module's path).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from itertools import filterfalse
from typing import NamedTuple

import numpy as np
import torch

from interp_runner.contracts import PatchColumns, PluginSpec, RequestPayload, plugin_spec_of
from interp_runner.models.layouts import layout_for
from interp_runner.payload import unpack_positions
from interp_runner.sites import ROUTER_LOGITS, site_of

from interp_runner.plugin.bank import PatchBank
from interp_runner.plugin.batch_plans import CELLS, PLANNED, BatchPlans, RequestColumns
from interp_runner.plugin.capture import CaptureBuffer, capture_groups
from interp_runner.plugin.checksum import RankChecksum
from interp_runner.plugin.kept_kv import KeptKV
from interp_runner.plugin.nonfinite import ResultFlags
from interp_runner.plugin.ops import activate, active_state
from interp_runner.plugin.patches import PatchRows
from interp_runner.plugin.readback import Readback
from interp_runner.plugin.records import RequestPlan
from interp_runner.plugin.runner_view import RunnerView, StepBatch
from interp_runner.plugin.sequences import PackedSequences
from interp_runner.plugin.staging import PinnedRing
from interp_runner.plugin.steering import SteeringTable
from interp_runner.plugin.worker import InterpWorkerExtension

__all__ = ["InterpState", "InterpWorkerExtension", "active_state", "state_for_current_engine"]


class _Building(NamedTuple):
    config_id: int  # id of the vLLM config whose model is being built
    state: weakref.ref  # its InterpState, held by the layers built so far (not here: it ends with its engine)


_building: _Building | None = None


def state_for_current_engine(spec: PluginSpec) -> InterpState:
    """The state of the engine whose model is being built (one per engine, shared by its layers)."""
    global _building
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    state = _building.state() if _building is not None and _building.config_id == id(config) else None
    if state is None:
        state = InterpState(config, spec)
        _building = _Building(id(config), weakref.ref(state))
    activate(state)
    return state


def _capture_width(vllm_config, site: int) -> int:
    """The width of a capture site's rows: the hidden size, or at ``router_logits`` the number of experts."""
    config = vllm_config.model_config.hf_text_config
    if site_of(site)[1] != ROUTER_LOGITS:
        return config.hidden_size
    layout = layout_for(vllm_config.model_config.hf_config.architectures[0])
    return getattr(config, layout.router_config[0])


@dataclass(slots=True)
class SteadyStep:
    """A decode step the next one may repeat: the same requests, one generated token each, and nothing but
    steering (or nothing) to apply: the buffers already hold it."""

    req_ids: tuple[str, ...]
    num_rows: int
    slots: bytes | None  # the rows' steering slots (None: none steered), folded again
    applied: bool  # whether it counts as a step that applied something


class DecodeStep(NamedTuple):
    """A planned step of one token a request: the next step may repeat it (``InterpState._repeats_next_step``,
    asked only once a next step of the same requests comes)."""

    plans: BatchPlans
    computed: np.ndarray
    num_rows: int
    busy: bool  # it captures, patches or scores: a next step needs buffers of its own


class InterpState:
    """One engine's interp state on a worker (shared by its instrumented layers): see the module's docstring."""

    def __init__(self, vllm_config, spec: PluginSpec | dict):
        from vllm.distributed import get_tensor_model_parallel_rank

        spec = plugin_spec_of(spec)

        hidden_size = vllm_config.model_config.hf_text_config.hidden_size
        dtype = vllm_config.model_config.dtype
        device = torch.get_default_device()
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.fingerprint = spec.plugin
        self.is_result_rank = get_tensor_model_parallel_rank() == 0
        self.instrumented_layers: set[int] = set()
        sched = vllm_config.scheduler_config
        self.max_rows = max_rows = max(sched.max_num_batched_tokens, sched.max_num_seqs) + 1024

        self.staging = staging = PinnedRing.for_device(device)
        self.rank_checksum = RankChecksum(vllm_config.parallel_config.world_size)
        fold = self._fold = self.rank_checksum.fold
        self.steering = SteeringTable(spec.steer_sites, hidden_size, dtype, device, max_rows,
                                      1 + 2 * sched.max_num_seqs, staging, fold)
        self.patch_bank = PatchBank(spec.bank_rows, hidden_size, dtype, device, staging, fold)
        self.patches = PatchRows(spec.patch_sites, self.patch_bank.values, device, max_rows,
                                 staging, fold)
        # captured rows are as wide as the widest site's (a router's logits: one per expert); each site's are read
        # back at its own width
        widths = {site: _capture_width(vllm_config, site) for site in spec.capture_sites}
        width = max([hidden_size, *widths.values()])
        self.readback = Readback(self.is_result_rank, staging, {s: w for s, w in widths.items() if w != width})
        self.result_flags = ResultFlags(max_rows, device, staging, self.is_result_rank)
        self.capture = CaptureBuffer(spec.capture_sites, width, dtype, device, max_rows,
                                     self.patch_bank, self.readback, staging, fold)
        self.kept_kv = KeptKV.for_engine(vllm_config, spec, staging, fold)
        self.packing = PackedSequences(self.patch_bank, self.kept_kv, staging, fold)
        self.steer_sites, self.capture_sites = self.steering.sites, self.capture.sites
        self.patch_sites, self.patch_index = self.patches.sites, self.patches.index

        self.requests: dict[str, RequestPlan | None] = {}  # worker request id -> plan (None: no payload)
        self._columns = RequestColumns()
        self._rows: dict[str, int] = {}  # worker request id -> its row of ``_columns`` (0: no plan)
        self._epoch = 0  # counts the changes of ``requests``: a batch's plans are made again after one
        self._batch: BatchPlans | None = None  # the last step's
        self._packed: set[str] = set()  # worker ids of the admitted packed requests
        self._steady: SteadyStep | None = None
        self._last_decode: DecodeStep | None = None
        # a step run layer by layer (``skipping.run_layers``): the sites whose op has work in it, called directly
        self.direct_sites: frozenset[int] | None = None
        # the op's parts, bound once
        self._steer = self.steering.steer
        self._patch = self.patches.patch
        self._patch_pair = self.patches.patch_pair
        self._capture = self.capture.capture
        self.flag_rows = self.result_flags.flag_rows

    # -- the op -------------------------------------------------------------------------------------
    def apply_site(self, x: torch.Tensor, extra: torch.Tensor | None, site: int) -> None:
        """The op's work at ``site``, in place on x: steer its rows, patch them, capture them (plus ``extra``). A
        site with nothing to do this step costs nothing but the call."""
        every = self._launches_everything(x)
        if every or self.steering.active:
            self._steer(x, site, not every)
        p = self.patch_index.get(site)
        if p is not None:  # a single tensor here: the embedding stream or a sub-layer output
            self._patch(x, p)
        if every or site in self.capture.step_sites:
            self._capture(site, x, extra)

    def _launches_everything(self, x: torch.Tensor) -> bool:
        """Whether the op launches all its kernels, work or not: captured into a CUDA graph (a later replay may
        need them), and in every run before the engine's first request (its warm-up runs compile the kernels, so
        none is compiled inside a capture). Otherwise, a step run outside the graphs (longer than they are, or on
        a CPU) launches only what it does, and steers through ATen rather than Triton (fewer host cycles a call)."""
        return not self.requests or (x.is_cuda and torch.cuda.is_current_stream_capturing())

    def apply_pair(self, x: torch.Tensor, extra: torch.Tensor, site: int) -> None:
        """The op's work at a residual-stream site that patches, in place on both halves (x + extra)."""
        self._steer(x, site, not self._launches_everything(x))
        self._patch_pair(x, extra, self.patch_index[site])
        self._capture(site, x, extra)

    def capture_only(self, x: torch.Tensor, site: int) -> None:
        """Capture at a capture-only site (``x``: [rows, width] at most the buffer's width, padded with zeros to it)."""
        if site not in self.capture.step_sites and not self._launches_everything(x):
            return  # a step that captures nothing here
        width = self.capture.cap_out.shape[1]
        if x.shape[1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
        self._capture(site, x, None)

    def step_sites(self) -> frozenset[int]:
        """The sites whose op has work this step (it steers, patches or captures some row); at the others the op
        returns its input's values."""
        sites = set(self.capture.step_sites)
        sites |= self.patches.step_sites()
        if self.steering.active:
            sites = sites | set(self.steer_sites)
        return frozenset(sites)

    def call_ops_directly(self, on: bool) -> None:
        """Enter (leave) a step run layer by layer: layers call the ops' work directly, only at ``direct_sites``."""
        self.direct_sites = self.step_sites() if on else None
        self.capture.direct = on

    # -- registered values --------------------------------------------------------------------------
    def register_vectors(self, vectors: dict[str, bytes]) -> int:
        return self.steering.register_vectors(vectors)

    def register_sources(self, sources: dict[str, bytes]) -> int:
        return self.patch_bank.register(sources)

    def release_sources(self, keys: list[str]) -> int:
        self.kept_kv.release(keys)
        return self.patch_bank.release(keys)

    # -- requests -----------------------------------------------------------------------------------
    def _admit(self, payload: RequestPayload | None, prompt_len: int) -> RequestPlan | None:
        if payload is None:
            return None
        plan = RequestPlan(rid=payload.rid, prompt_len=prompt_len)
        if payload.steer:
            plan.steer_key, slots = self.steering.acquire(payload.steer)
            plan.prefill_slot, plan.decode_slot = slots.prefill, slots.decode
        if payload.capture:
            plan.capture_groups = capture_groups(payload.capture)
        keep = payload.keep
        if keep is not None:
            plan.keep, writes = self.patch_bank.reserve_kept(keep)
            plan.bank_keys += tuple(writes)
            if keep.kv and self.kept_kv.reserve(keep.run, prompt_len):
                plan.kv_keep = keep.run
        if payload.score is not None:
            plan.score_ids = unpack_positions(payload.score).astype(np.int64)
        if payload.patch is not None:
            self._admit_patch(plan, payload.patch)
        cells = payload.cells
        if cells is not None:
            self.packing.admit(plan, cells)
            if plan.void is not None:
                voided = self.readback.voided
                voided.pop(plan.rid, None)
                for rid in plan.cells.rids:
                    voided[rid] = plan.void
        self.result_flags.acquire(plan)
        return plan

    def _admit_patch(self, plan: RequestPlan, patch: PatchColumns) -> None:
        keys = patch.sources
        missing = self.patch_bank.missing(keys)
        if missing:  # never run it as if patched: it is reported void
            plan.void = f"{len(missing)} patch source(s) not on the worker, e.g. {missing[0]}"
            self.readback.voided[plan.rid] = plan.void
            return
        rows = self.patch_bank.rows
        plan.patch = self.patches.entries(patch, [rows[k] for k in keys])
        used = tuple(set(keys))
        plan.bank_keys += used
        self.patch_bank.use(used)

    def _plans(self, view: RunnerView, batch: StepBatch) -> BatchPlans:
        """The plans of the step's requests, in batch order (new requests admitted); made once per batch."""
        self.forget_finished(view.live_requests())
        req_ids = tuple(batch.req_ids)
        last = self._batch
        if last is not None and last.epoch == self._epoch and last.req_ids == req_ids:
            return last
        requests, rows = self.requests, self._rows
        for rid in req_ids:
            if rid not in requests:
                plan = requests[rid] = self._admit(*view.new_request(rid))
                rows[rid] = 0 if plan is None else self._columns.add(plan)
                self._epoch += 1
                if plan is not None and plan.cells is not None:
                    self._packed.add(rid)
        index = np.fromiter(map(rows.__getitem__, req_ids), dtype=np.intp, count=len(req_ids))
        self._batch = BatchPlans(req_ids, [requests[rid] for rid in req_ids], index, self._columns, self._epoch)
        return self._batch

    def forget_finished(self, live_requests) -> None:
        for rid in list(filterfalse(live_requests.__contains__, self.requests)):
            self._packed.discard(rid)
            self._columns.remove(self._rows.pop(rid))
            self._release(self.requests.pop(rid))
            self._epoch += 1

    def finished(self, rids: list[str]) -> None:
        """Requests the engine reported finished: what they hold is freed now, not when the runner drops them (at
        its next step, which a reused engine may not take before the next run registers its sources)."""
        done = set(rids)
        for rid, plan in self.requests.items():
            if plan is not None and plan.rid in done:
                self.requests[rid] = None  # nothing left to apply, should a step still hold it
                self._columns.remove(self._rows[rid])
                self._rows[rid] = 0
                self._epoch += 1
                self._release(plan)

    def _release(self, plan: RequestPlan | None) -> None:
        if plan is not None:
            self.result_flags.release(plan)
            self.patch_bank.finish(plan.bank_keys, plan.streams)
            self.kept_kv.finish(plan.kv_runs)
            if plan.kv_keep is not None:
                self.kept_kv.finish((plan.kv_keep,), writer=True)
            if plan.steer_key is not None:
                self.steering.release(plan.steer_key)

    # -- per step -----------------------------------------------------------------------------------
    def plan_sequences(self, view: RunnerView) -> None:
        """A step with packed cells: its attention sequences (``sequences.PackedSequences.plan``) and the cells it
        scores. Nothing changes in a step without packed cells."""
        packing = self.packing
        packing.sequences, packing.row_of = None, None
        self.readback.cells, self.readback.only_packed = None, False
        batch = view.batch()
        requests, packed = self.requests, self._packed
        ids = batch.req_ids
        if all(map(requests.__contains__, ids)) if not packed else \
                not any(rid not in requests or rid in packed for rid in ids):
            return  # the usual step (a decode step, say): every request admitted, none packed
        plans = self._plans(view, batch)
        if not plans.any_kind & CELLS:
            return
        self.readback.cells = packing.plan(plans.plans, batch, view)
        self.readback.only_packed = bool((plans.kinds & CELLS).all())

    def before_forward(self, view: RunnerView, num_rows: int) -> bool:
        """Fill this step's buffers; returns whether this step captures outside the buffers (it must run outside
        the CUDA graphs)."""
        batch = view.batch()
        n, req_ids, query_start = batch.num_reqs, batch.req_ids, batch.query_start
        steady, self._steady = self._steady, None
        last, self._last_decode = self._last_decode, None
        if last is not None and num_rows == last.num_rows and query_start[n] == n \
                and last.plans.req_ids == tuple(req_ids) \
                and self._repeats_next_step(last.plans, last.computed, last.busy):
            # a planned step of the same requests, its buffers still held
            steady = SteadyStep(last.plans.req_ids, num_rows, self.steering.held_slots(n), True)
        elif steady is not None and not (num_rows == steady.num_rows and query_start[n] == n
                                         and steady.req_ids == tuple(req_ids)):
            steady = None
        if steady is not None:
            # the same requests, one generated token each, nothing but steering (or nothing) left to apply:
            # the buffers already hold this step
            self.rank_checksum.steps += steady.applied
            if steady.slots is not None:
                self._fold(b"steer", steady.slots)
            self.readback.score_rows = []
            self._steady = steady
            return False
        plans = self._plans(view, batch)
        self.result_flags.flush()  # released slots' flags copied out and zeroed before their next owner's rows
        readback = self.readback
        readback.score_rows = []
        if not plans.any_kind & PLANNED:
            self.result_flags.clear()
            self.steering.clear()
            self.patches.plan(None, None, None, None)
            captures = self.capture.plan(None, None, None, None)
            if query_start[n] == n:
                self._steady = SteadyStep(tuple(req_ids), num_rows, None, False)
            return captures

        starts = query_start[: n + 1].astype(np.int64)
        computed = batch.computed[:n].astype(np.int64)
        self.rank_checksum.steps += 1
        row_of = self.packing.row_of
        self.patches.plan(plans, starts, computed, row_of)
        readback.plan(plans, starts, computed)
        if self.kept_kv.keeping:
            self.kept_kv.plan_out(view, plans.plans, starts, computed)
        num_tokens = int(starts[n])
        self.steering.plan(plans, starts, computed, num_rows, num_tokens, row_of)
        packed = [(i, plans.plans[i]) for i in plans.where(CELLS)]
        self.result_flags.plan(plans.flag_slot, packed, starts, computed, num_rows, num_tokens, row_of)
        captures = self.capture.plan(plans, starts, computed, row_of)
        if num_tokens == n:
            busy = captures or self.capture.pending or self.patches.active or bool(readback.score_rows)
            self._last_decode = DecodeStep(plans, computed, num_rows, busy)
        return captures

    def _repeats_next_step(self, plans: BatchPlans, computed, busy: bool) -> bool:
        """Whether a next step of the same requests, one generated token each, needs exactly the buffers of a
        step (``plans``, ``computed``) that did not capture, patch or score (``busy``): every row already a
        generated token (decode slots), no scores, patches or captures later (each request past its last position
        with such work: ``BatchPlans.quiet``)."""
        return not busy and bool((computed > plans.quiet).all())

    def after_forward(self) -> None:
        """Keep this step's captured rows (on the device; read back in bulk); copy its kept rows into the bank,
        whose keys then count as registered."""
        self.capture.after_forward(self.is_result_rank)
        self.kept_kv.after_forward()

    # -- results ------------------------------------------------------------------------------------
    def checksum(self) -> dict:
        return self.rank_checksum.as_dict()

    def collect(self, rids: list[str], reserve=None) -> dict[str, dict]:
        """Per finished request: ``captures`` (site -> (positions, values); later rows win), ``score``, ``void``
        (why its patches could not be applied) and ``nonfinite`` (computed through a non-finite value: its final
        norm's input, or a row of logits it was scored from). ``reserve``: room for the captured rows, which the
        device's rows are copied straight into (``Readback.read_back``)."""
        out = self.readback.collect(rids, reserve)
        flagged = self.result_flags.collect(rids)
        for rid, result in out.items():
            score = result["score"]
            bad_logits = score.pop("nonfinite", False) if score is not None else False
            result["nonfinite"] = flagged[rid] or bad_logits
        return out

    # -- views of the components' buffers (tests read them, and swap ``cap_out`` for a smaller one) ---
    @property
    def cap_out(self) -> torch.Tensor:
        return self.capture.cap_out

    @cap_out.setter
    def cap_out(self, value: torch.Tensor) -> None:
        self.capture.cap_out = value

    @property
    def bank(self) -> torch.Tensor:
        return self.patch_bank.values

    @property
    def bank_rows(self) -> dict[str, int]:
        return self.patch_bank.rows

    @property
    def _unwritten(self) -> set[str]:
        return self.patch_bank.unwritten

    @property
    def _released(self) -> set[str]:
        return self.patch_bank.released

    @property
    def sequences(self) -> dict | None:
        return self.packing.sequences
