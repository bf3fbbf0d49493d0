"""Engine-side state of the interp ops: persistent buffers, the per-step planner and per-request results.

Every buffer the ops read is allocated once, when the model is built, so CUDA graphs captured at start-up keep
pointing at them; each step only rewrites their contents:

- ``row_slot[t]``: the steering slot of batch row ``t`` (slot 0 holds zeros: rows without steering keep their
  value bit for bit);
- ``table[site, slot]``: the summed steering vector of a slot at a steered site. A request gets two slots, one
  for its prompt tokens (base + prefill tiers) and one for generated tokens (base + decode tiers); requests with
  the same steering share them.

- ``bank[row]``: patch source values (row 0 is zeros), registered by key and kept while requests use them;
- ``patch_idx / patch_coef / patch_mask [patch site, row]``: per batch row, the bank row and (a, b) of the patch
  applied there (``kernels.reference.patch_rows``); rows without a patch are masked out and keep their bits.

Capture copies rows out inside the op. Steps that capture run outside CUDA graphs (the op then sees this step's
rows); all other steps replay the graphs, in which capture costs nothing. Scoring reads the log-probabilities of
given token ids from the logits of the step that computes a request's last prompt token.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from interp_runner.payload import DECODE, PAYLOAD_KEY, PREFILL, unpack_positions
from interp_runner_kernels.reference import gather_add, gather_rows, patch_pair, patch_rows

_active: InterpState | None = None
_building: tuple[int, InterpState] | None = None


def active_state() -> InterpState:
    if _active is None:
        raise RuntimeError("interp op called outside an instrumented engine")
    return _active


def state_for_current_engine(spec: dict) -> InterpState:
    """The state of the engine whose model is being built (one per engine, shared by its layers)."""
    global _active, _building
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    if _building is None or _building[0] != id(config):
        _building = (id(config), InterpState(config, spec))
    _active = _building[1]
    return _active


@dataclass
class RequestPlan:
    rid: str
    prompt_len: int
    steer_key: tuple | None = None
    prefill_slot: int = 0
    decode_slot: int = 0
    # (sites, captured prompt positions, captures generated tokens)
    capture_groups: list[tuple[tuple[int, ...], np.ndarray, bool]] = field(default_factory=list)
    # patch entries sorted by position: (position, patch site index, bank row, a, b)
    patch: tuple[np.ndarray, ...] | None = None
    bank_keys: tuple[str, ...] = ()
    score_ids: np.ndarray | None = None
    void: str | None = None


class InterpState:
    def __init__(self, vllm_config, spec: dict):
        from vllm.distributed import get_tensor_model_parallel_rank

        hf = vllm_config.model_config.hf_text_config
        self.hidden_size = hf.hidden_size
        self.dtype = vllm_config.model_config.dtype
        self.device = torch.get_default_device()
        self.fingerprint = spec["plugin"]
        self.steer_sites = tuple(spec["steer_sites"])
        self.capture_sites = tuple(spec["capture_sites"])
        self.steer_index = {site: i for i, site in enumerate(self.steer_sites)}
        self.patch_sites = tuple(spec.get("patch_sites", ()))
        self.patch_index = {site: i for i, site in enumerate(self.patch_sites)}
        self.is_result_rank = get_tensor_model_parallel_rank() == 0
        self.instrumented_layers: set[int] = set()

        sched = vllm_config.scheduler_config
        self.max_rows = max(sched.max_num_batched_tokens, sched.max_num_seqs) + 1024
        self.num_slots = 1 + 2 * sched.max_num_seqs
        self.row_slot = torch.zeros(self.max_rows, dtype=torch.int64, device=self.device)
        self.table = torch.zeros(
            (max(len(self.steer_sites), 1), self.num_slots, self.hidden_size),
            dtype=self.dtype,
            device=self.device,
        )
        self._row_slot_dirty = False
        num_patch = max(len(self.patch_sites), 1)
        self.bank = torch.zeros((int(spec.get("bank_rows", 0)) + 1, self.hidden_size), dtype=self.dtype,
                                device=self.device)
        self.patch_idx = torch.zeros((num_patch, self.max_rows), dtype=torch.int64, device=self.device)
        self.patch_coef = torch.zeros((num_patch, self.max_rows, 2), dtype=torch.float32, device=self.device)
        self.patch_mask = torch.zeros((num_patch, self.max_rows), dtype=torch.bool, device=self.device)
        self._patched_flat: torch.Tensor | None = None  # entries written last step, cleared before the next
        self.bank_rows: dict[str, int] = {}
        self._bank_users: dict[str, int] = {}
        self._released: set[str] = set()
        self._free_bank = list(range(self.bank.shape[0] - 1, 0, -1))
        self.pending_scores: list[tuple[int, str, np.ndarray]] = []
        self._free_slots = list(range(self.num_slots - 1, 0, -1))
        self._slot_users: dict[tuple, list] = {}  # steer key -> [prefill slot, decode slot, refcount]

        self.vectors: dict[str, np.ndarray] = {}
        self.requests: dict[str, RequestPlan | None] = {}  # worker request id -> plan (None: no payload)
        self.capture_rows: dict[int, torch.Tensor] = {}
        self._capture_meta: dict[int, list[tuple[str, np.ndarray]]] = {}
        self.captured: list[tuple[int, torch.Tensor]] = []
        self.results: dict[str, dict[int, list[tuple[np.ndarray, np.ndarray]]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self.scores: dict[str, dict] = {}
        self.voided: dict[str, str] = {}

    # -- the op -------------------------------------------------------------------------------------
    def _steer(self, x: torch.Tensor, site: int) -> torch.Tensor:
        index = self.steer_index.get(site)
        return x.clone() if index is None else gather_add(x, self.table[index], self.row_slot)

    def _capture(self, site: int, out: torch.Tensor, extra: torch.Tensor | None) -> None:
        if self.capture_rows:
            rows = self.capture_rows.get(site)
            if rows is not None:
                self.captured.append((site, gather_rows(out, rows, extra)))

    def apply_site(self, x: torch.Tensor, extra: torch.Tensor | None, site: int) -> torch.Tensor:
        out = self._steer(x, site)
        p = self.patch_index.get(site)
        if p is not None:  # a single tensor here: the embedding stream or a sub-layer output
            out = patch_rows(out, self.bank, self.patch_idx[p], self.patch_coef[p], self.patch_mask[p])
        self._capture(site, out, extra)
        return out

    def apply_pair(self, x: torch.Tensor, extra: torch.Tensor, site: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.patch_index[site]
        out, extra = patch_pair(
            self._steer(x, site), extra, self.bank, self.patch_idx[p], self.patch_coef[p], self.patch_mask[p]
        )
        self._capture(site, out, extra)
        return out, extra

    # -- vectors and slots --------------------------------------------------------------------------
    def register_vectors(self, vectors: dict[str, bytes]) -> int:
        for key, data in vectors.items():
            vec = np.frombuffer(data, dtype=np.float32)
            if vec.shape != (self.hidden_size,):
                raise ValueError(f"vector {key}: length {vec.size}, model hidden size {self.hidden_size}")
            self.vectors[key] = vec
        return len(self.vectors)

    def register_sources(self, sources: dict[str, bytes]) -> int:
        """Patch source values into the bank (a key already there is kept); returns the rows in use."""
        new = [k for k in sources if k not in self.bank_rows]
        if len(new) > len(self._free_bank):
            raise RuntimeError(
                f"interp patch bank is full: {len(new)} new sources, {len(self._free_bank)} free rows "
                f"of {self.bank.shape[0] - 1}"
            )
        for key in new:
            vec = np.frombuffer(sources[key], dtype=np.float32)
            if vec.shape != (self.hidden_size,):
                raise ValueError(f"source {key}: length {vec.size}, model hidden size {self.hidden_size}")
            row = self._free_bank.pop()
            self.bank[row].copy_(torch.from_numpy(vec.copy()).to(self.dtype))
            self.bank_rows[key] = row
        self._released.difference_update(sources)
        return len(self.bank_rows)

    def release_sources(self, keys: list[str]) -> int:
        """Drop sources now, or when the last admitted request using them finishes."""
        for key in keys:
            if key in self.bank_rows:
                self._released.add(key)
                self._free_source_if_unused(key)
        return len(self.bank_rows)

    def _free_source_if_unused(self, key: str) -> None:
        if key in self._released and not self._bank_users.get(key):
            self._released.discard(key)
            self._bank_users.pop(key, None)
            self._free_bank.append(self.bank_rows.pop(key))

    def _acquire_slots(self, steer: list) -> tuple[tuple, int, int]:
        key = tuple(sorted((int(s), int(p), str(k), float(c)) for s, p, k, c in steer))
        users = self._slot_users.get(key)
        if users is None:
            if len(self._free_slots) < 2:
                raise RuntimeError("interp steering table is full")
            users = [self._free_slots.pop(), self._free_slots.pop(), 0]
            sums = np.zeros((2, len(self.steer_sites), self.hidden_size), dtype=np.float32)
            for site, phases, vkey, scale in key:
                if vkey not in self.vectors:
                    raise KeyError(f"steering vector {vkey} was not registered on the worker")
                for phase_index, phase in enumerate((PREFILL, DECODE)):
                    if phases & phase:
                        sums[phase_index, self.steer_index[site]] += np.float32(scale) * self.vectors[vkey]
            values = torch.from_numpy(sums).to(self.dtype)
            self.table[:, users[0]].copy_(values[0])
            self.table[:, users[1]].copy_(values[1])
            self._slot_users[key] = users
        users[2] += 1
        return key, users[0], users[1]

    def _release(self, plan: RequestPlan) -> None:
        for key in plan.bank_keys:
            self._bank_users[key] -= 1
            self._free_source_if_unused(key)
        if plan.steer_key is None:
            return
        users = self._slot_users[plan.steer_key]
        users[2] -= 1
        if users[2] == 0:
            del self._slot_users[plan.steer_key]
            self._free_slots.extend((users[0], users[1]))

    # -- per step -----------------------------------------------------------------------------------
    def _admit(self, request) -> RequestPlan | None:
        extra = request.sampling_params.extra_args if request.sampling_params else None
        payload = (extra or {}).get(PAYLOAD_KEY)
        if payload is None:
            return None
        plan = RequestPlan(rid=payload["rid"], prompt_len=request.num_prompt_tokens)
        if payload.get("steer"):
            plan.steer_key, plan.prefill_slot, plan.decode_slot = self._acquire_slots(payload["steer"])
        merged: dict[tuple, list[int]] = {}
        for sites, positions, generated in payload.get("capture", ()):
            merged.setdefault((bytes(positions), bool(generated)), []).extend(sites)
        plan.capture_groups = [
            (tuple(sorted(set(sites))), unpack_positions(positions), generated)
            for (positions, generated), sites in merged.items()
        ]
        if payload.get("score") is not None:
            plan.score_ids = unpack_positions(payload["score"]).astype(np.int64)
        if payload.get("patch"):
            self._admit_patch(plan, payload["patch"])
        return plan

    def _admit_patch(self, plan: RequestPlan, patch: dict) -> None:
        keys = patch["src"]
        missing = sorted({k for k in keys if k not in self.bank_rows})
        if missing:  # never run it as if patched: it is reported void
            plan.void = f"{len(missing)} patch source(s) not on the worker, e.g. {missing[0]}"
            self.voided[plan.rid] = plan.void
            return
        sites = unpack_positions(patch["site"])
        positions = unpack_positions(patch["pos"]).astype(np.int64)
        # one entry per (site, position): a later entry wins
        _, last = np.unique((sites.astype(np.int64) * (1 << 32) + positions)[::-1], return_index=True)
        keep = len(positions) - 1 - last
        order = keep[np.argsort(positions[keep], kind="stable")]
        plan.patch = (
            positions[order],
            np.array([self.patch_index[int(s)] for s in sites], dtype=np.int64)[order],
            np.array([self.bank_rows[k] for k in keys], dtype=np.int64)[order],
            np.frombuffer(patch["a"], dtype=np.float32)[order],
            np.frombuffer(patch["b"], dtype=np.float32)[order],
        )
        plan.bank_keys = tuple(set(keys))
        for key in plan.bank_keys:
            self._bank_users[key] = self._bank_users.get(key, 0) + 1

    def forget_finished(self, live_requests) -> None:
        for rid in [r for r in self.requests if r not in live_requests]:
            plan = self.requests.pop(rid)
            if plan is not None:
                self._release(plan)

    def before_forward(self, runner, num_rows: int) -> bool:
        """Fill this step's buffers; returns whether this step captures."""
        batch = runner.input_batch
        n = batch.num_reqs
        req_ids = batch.req_ids[:n]
        self.forget_finished(runner.requests)
        plans = []
        for rid in req_ids:
            if rid not in self.requests:
                self.requests[rid] = self._admit(runner.requests[rid])
            plans.append(self.requests[rid])
        self.pending_scores = []
        if not any(plans):
            if self._row_slot_dirty:
                self.row_slot.zero_()
                self._row_slot_dirty = False
            self._plan_patches([], None, None)
            return False

        starts = runner.query_start_loc.np[: n + 1].astype(np.int64)
        computed = batch.num_computed_tokens_cpu[:n].astype(np.int64)
        self._plan_patches(plans, starts, computed)
        for i, plan in enumerate(plans):
            if plan is not None and plan.score_ids is not None and computed[i] + starts[i + 1] - starts[i] \
                    == plan.prompt_len:
                self.pending_scores.append((i, plan.rid, plan.score_ids))
        num_tokens = int(starts[n])
        if any(p is not None and p.steer_key is not None for p in plans):
            counts = np.diff(starts)
            owner = np.repeat(np.arange(n), counts)
            positions = computed[owner] + np.arange(num_tokens) - starts[owner]
            prompt_len = np.array([p.prompt_len if p else 0 for p in plans], dtype=np.int64)
            prefill = np.array([p.prefill_slot if p else 0 for p in plans], dtype=np.int64)
            decode = np.array([p.decode_slot if p else 0 for p in plans], dtype=np.int64)
            slots = np.zeros(num_rows, dtype=np.int64)
            slots[:num_tokens] = np.where(
                positions < prompt_len[owner], prefill[owner], decode[owner]
            )
            self.row_slot[:num_rows].copy_(torch.from_numpy(slots), non_blocking=True)
            self._row_slot_dirty = True
        elif self._row_slot_dirty:
            self.row_slot.zero_()
            self._row_slot_dirty = False

        rows_by_site: dict[int, list[np.ndarray]] = defaultdict(list)
        meta: dict[int, list[tuple[str, np.ndarray]]] = defaultdict(list)
        for i, plan in enumerate(plans):
            if plan is None or not plan.capture_groups:
                continue
            first, count = int(computed[i]), int(starts[i + 1] - starts[i])
            positions = np.arange(first, first + count)
            for sites, prompt_positions, generated in plan.capture_groups:
                keep = np.isin(positions, prompt_positions)
                if generated:
                    keep |= positions >= plan.prompt_len
                if not keep.any():
                    continue
                chosen = positions[keep]
                rows = chosen - first + starts[i]
                for site in sites:
                    rows_by_site[site].append(rows)
                    meta[site].append((plan.rid, chosen))
        device_rows: dict[bytes, torch.Tensor] = {}
        self.capture_rows = {}
        for site, parts in rows_by_site.items():
            rows = np.concatenate(parts)
            key = rows.tobytes()
            if key not in device_rows:
                device_rows[key] = torch.from_numpy(rows).to(self.device, non_blocking=True)
            self.capture_rows[site] = device_rows[key]
        self._capture_meta = dict(meta)
        return bool(self.capture_rows)

    def _plan_patches(self, plans, starts, computed) -> None:
        """Point this step's patched rows at their bank rows; rows patched last step are unmasked first."""
        flats, banks, coefs = [], [], []
        for i, plan in enumerate(plans):
            if plan is None or plan.patch is None:
                continue
            positions, site_index, bank_row, a, b = plan.patch
            first, count = int(computed[i]), int(starts[i + 1] - starts[i])
            lo, hi = np.searchsorted(positions, (first, first + count))
            if lo == hi:
                continue
            rows = positions[lo:hi] - first + starts[i]
            flats.append(site_index[lo:hi] * self.max_rows + rows)
            banks.append(bank_row[lo:hi])
            coefs.append(np.stack([a[lo:hi], b[lo:hi]], axis=1))
        mask = self.patch_mask.view(-1)
        if self._patched_flat is not None:
            mask[self._patched_flat] = False
            self._patched_flat = None
        if not flats:
            return
        flat = torch.from_numpy(np.concatenate(flats)).to(self.device, non_blocking=True)
        self.patch_idx.view(-1)[flat] = torch.from_numpy(np.concatenate(banks)).to(self.device, non_blocking=True)
        self.patch_coef.view(-1, 2)[flat] = torch.from_numpy(np.concatenate(coefs)).to(self.device,
                                                                                       non_blocking=True)
        mask[flat] = True
        self._patched_flat = flat

    def record_scores(self, logits: torch.Tensor) -> None:
        """Log-probabilities of each scored request's token ids (any rank), and its top token."""
        pending, self.pending_scores = self.pending_scores, []
        if not self.is_result_rank:
            return
        rows = torch.tensor([i for i, _, _ in pending], device=logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
        top_lp, top_id = logprobs.max(dim=-1)
        width = max(len(ids) for _, _, ids in pending)
        ids = np.zeros((len(pending), width), dtype=np.int64)
        for j, (_, _, tokens) in enumerate(pending):
            ids[j, : len(tokens)] = tokens
        chosen = logprobs.gather(1, torch.from_numpy(ids).to(logits.device)).cpu().numpy()
        top_lp, top_id = top_lp.cpu().numpy(), top_id.cpu().numpy()
        for j, (_, rid, tokens) in enumerate(pending):
            self.scores[rid] = {
                "token_ids": tokens.astype(np.int32), "logprobs": chosen[j, : len(tokens)].astype(np.float32),
                "top_id": int(top_id[j]), "top_logprob": float(top_lp[j]),
            }

    def after_forward(self) -> None:
        if not self.capture_rows:
            return
        captured, self.captured, self.capture_rows = self.captured, [], {}
        if not self.is_result_rank or not captured:
            return
        values = torch.cat([t for _, t in captured]).float().cpu().numpy()
        offset = 0
        for site, tensor in captured:
            for rid, positions in self._capture_meta[site]:
                k = len(positions)
                self.results[rid][site].append((positions, values[offset : offset + k]))
                offset += k

    def collect(self, rids: list[str]) -> dict[str, dict]:
        """Per finished request: ``captures`` (site -> (positions, values); later rows win), ``score`` and
        ``void`` (why its patches could not be applied)."""
        out = {}
        for rid in rids:
            per_site = self.results.pop(rid, {})
            merged = {}
            for site, chunks in per_site.items():
                positions = np.concatenate([p for p, _ in chunks])
                values = np.concatenate([v for _, v in chunks])
                # a recomputed (preempted) request captures a position again: keep the last copy
                last = len(positions) - 1 - np.unique(positions[::-1], return_index=True)[1]
                merged[site] = (positions[last].astype(np.int32), values[last])
            out[rid] = {"captures": merged, "score": self.scores.pop(rid, None), "void": self.voided.pop(rid, None)}
        return out


def _state_of(runner) -> InterpState | None:
    cached = runner.__dict__.get("_interp_state", False)
    if cached is not False:
        return cached
    state = None
    if hasattr(runner, "model"):
        for module in runner.get_model().modules():
            state = getattr(module, "_interp_state", None)
            if state is not None:
                break
        if state is not None:
            _score_logits(runner.model, state)
        runner._interp_state = state
    return state


def _score_logits(model, state: InterpState) -> None:
    """Wrap the model's compute_logits (outside the compiled graph) so scoring steps read their logits."""
    original = model.compute_logits

    def compute_logits(hidden_states, *args, **kwargs):
        logits = original(hidden_states, *args, **kwargs)
        if state.pending_scores and logits is not None:
            state.record_scores(logits)
        return logits

    model.compute_logits = compute_logits


def instrument_model_runner() -> None:
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if "_interp_original_model_forward" in GPUModelRunner.__dict__:
        return
    original = GPUModelRunner._model_forward
    GPUModelRunner._interp_original_model_forward = original

    def _model_forward(self, *args, **kwargs):
        global _active
        state = _state_of(self)
        if state is None:
            return original(self, *args, **kwargs)
        _active = state
        positions = kwargs.get("positions")
        if state.before_forward(self, positions.shape[-1]):
            context = get_forward_context()
            context.cudagraph_runtime_mode = CUDAGraphMode.NONE
        try:
            return original(self, *args, **kwargs)
        finally:
            state.after_forward()

    GPUModelRunner._model_forward = _model_forward


class InterpWorkerExtension:
    """Methods vLLM mixes into its workers; the runner calls them through ``collective_rpc``."""

    def _interp(self) -> InterpState:
        state = _state_of(self.model_runner)
        if state is None:
            raise RuntimeError("this engine was built without interp ops")
        return state

    def interp_status(self) -> dict:
        state = _state_of(self.model_runner)
        if state is None:
            return {"loaded": False}
        return {
            "loaded": True,
            # the planner lives in GPUModelRunner._model_forward: any other runner would never plan a step
            "runner_planned": any(
                "_interp_original_model_forward" in c.__dict__ for c in type(self.model_runner).__mro__
            ),
            "plugin": state.fingerprint,
            "instrumented_layers": sorted(state.instrumented_layers),
            "steer_sites": list(state.steer_sites),
            "capture_sites": list(state.capture_sites),
            "patch_sites": list(state.patch_sites),
            "bank_rows": state.bank.shape[0] - 1,
            "result_rank": state.is_result_rank,
        }

    def interp_register_vectors(self, vectors: dict[str, bytes]) -> int:
        return self._interp().register_vectors(vectors)

    def interp_register_sources(self, sources: dict[str, bytes]) -> int:
        state = self._interp()
        state.forget_finished(self.model_runner.requests)
        return state.register_sources(sources)

    def interp_release_sources(self, keys: list[str]) -> int:
        state = self._interp()
        state.forget_finished(self.model_runner.requests)
        return state.release_sources(keys)

    def interp_collect(self, rids: list[str]) -> dict:
        state = self._interp()
        return state.collect(rids) if state.is_result_rank else {}
