"""Engine-side state of the interp ops: persistent buffers, the per-step planner and per-request results.

Every buffer the ops read is allocated once, when the model is built, so CUDA graphs captured at start-up keep
pointing at them; each step only rewrites their contents:

- ``row_slot[t]``: the steering slot of batch row ``t`` (slot 0 holds zeros: rows without steering keep their
  value bit for bit);
- ``table[site, slot]``: the summed steering vector of a slot at a steered site. A request gets two slots, one
  for its prompt tokens (base + prefill tiers) and one for generated tokens (base + decode tiers); requests with
  the same steering share them.

- ``bank[row]``: patch source values (row 0 is zeros), registered by key and kept while requests use them; a
  request's ``keep`` values reach the bank through the capture op: their rows of ``cap_out`` are copied there on
  the device after the step, and their keys count as registered from the next step on;
- ``patch_idx / patch_coef / patch_mask [patch site, row]``: per batch row, the bank row and (a, b) of the patch
  applied there (``kernels.reference.patch_rows``); rows without a patch are masked out and keep their bits.

- ``cap_src / cap_dest [capture site, row]``, ``cap_count [capture site]``: per capture site, which batch rows
  the op copies (``cap_src[:count]``) to which rows of ``cap_out``, one buffer shared by all sites. The kernel
  reads the count on the device, so capture runs inside CUDA graphs; a step that captures nothing costs one
  near-empty launch per capture site. A step whose captures exceed ``cap_out`` runs outside the graphs and copies
  its rows out directly (``capture_rows``).

No step waits for the GPU. Host arrays reach the device through a ring of pinned memory (``PinnedRing``: a copy
from pageable memory would first wait for all queued work). A capturing step's rows are copied out of ``cap_out``
on the device, and scores (read from the logits of the step that computes a request's last prompt token) stay
there too; both are read back in bulk, when results are collected or once ``PENDING_BYTES`` have gathered.

Every rank folds what it applies into a running checksum (``digest``): the registered vectors, the steering table
slots and the vector sets they hold, the patch entries and bank values, the capture rows, per step. The runner
compares the ranks' digests.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from interp_runner.payload import DECODE, PAYLOAD_KEY, PREFILL, pack_results, ref_key, unpack_positions
from interp_runner.sites import site_id

from . import skipping
import interp_runner_kernels as kernels
from interp_runner_kernels.reference import gather_rows

STAGING_BYTES = 16 << 20  # pinned host ring for the planner's uploads
PENDING_BYTES = 256 << 20  # device-side results read back once this much has gathered

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


class PinnedRing:
    """Host arrays to the device without a wait: each is written into the next free part of one pinned buffer and
    copied from there asynchronously. The buffer is rewritten from its start only after the stream has finished
    every copy queued so far (one wait per ``nbytes`` uploaded). With ``nbytes`` 0 (CPU engines) arrays are copied
    directly."""

    ALIGN = 64

    def __init__(self, nbytes: int, device: torch.device, synchronize=None):
        self.device = device
        # on the host even where the engine sets a default device for model construction
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu",
                                  pin_memory=nbytes > 0 and device.type == "cuda")
        self.offset = 0
        self.wraps = 0
        self._synchronize = synchronize or (lambda: torch.cuda.current_stream().synchronize())

    def upload(self, array: np.ndarray, into: torch.Tensor | None = None) -> torch.Tensor:
        """``array`` on the device: a new tensor, or copied into ``into`` (same number of elements)."""
        array = np.ascontiguousarray(array)
        size = -(-array.nbytes // self.ALIGN) * self.ALIGN
        if size > self.buffer.numel():  # larger than the ring (or no ring): a plain copy
            host = torch.from_numpy(array if array.flags.writeable else array.copy())
            return host.to(self.device) if into is None else into.copy_(host.view(into.shape))
        if self.offset + size > self.buffer.numel():
            self._synchronize()  # every copy out of the ring has run: its start may be rewritten
            self.offset = 0
            self.wraps += 1
        part = self.buffer[self.offset : self.offset + array.nbytes]
        self.offset += size
        host = part.view(torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype).view(array.shape)
        host.numpy()[...] = array
        if into is not None:
            return into.copy_(host.view(into.shape), non_blocking=True)
        return host.to(self.device, non_blocking=True)


@dataclass
class RequestPlan:
    rid: str
    prompt_len: int
    steer_key: tuple | None = None
    prefill_slot: int = 0
    decode_slot: int = 0
    # (sites, captured prompt positions, captures generated tokens, lowest and highest prompt position)
    capture_groups: list[tuple[tuple[int, ...], np.ndarray, bool, int, int]] = field(default_factory=list)
    # patch entries sorted by position, as lists: (positions, flat [patch site, position] index, bank rows, a, b)
    patch: tuple[list, ...] | None = None
    patch_span: tuple[int, int] = (0, -1)  # lowest and highest patched position
    bank_keys: tuple[str, ...] = ()
    score_ids: np.ndarray | None = None
    void: str | None = None
    cells: CellLayout | None = None
    streams: tuple = ()  # (run, site) of the kept streams its cells start from
    # values kept in the bank: (sites, positions, lowest, highest, bank rows [site, position] (-1: not kept here),
    # their keys)
    keep: list[tuple[tuple[int, ...], np.ndarray, int, int, np.ndarray, np.ndarray]] = field(default_factory=list)


@dataclass
class CellLayout:
    """A packed request's cells (``interp_runner.packing``): segment ``k`` holds prompt positions ``prefix ..
    prefix + length - 1`` at ``prefix + k * stride``, padded to ``stride``."""

    prefix: int
    stride: int
    length: int
    rids: list[str]
    score_ids: list[np.ndarray]
    # cells that skip layers: each one's first layer, and the bank rows of its segment's stream there (row 0, zeros,
    # for padding)
    start: np.ndarray | None = None
    inject: np.ndarray | None = None


def capture_groups(specs) -> list[tuple]:
    """A request's capture specs ``[sites, positions, generated]`` as groups ``(sites, positions, generated, lo,
    hi)`` in which every site appears once: a site named by several specs gets the union of their positions (a
    step then copies each of its rows once, so a site never captures more rows than the step has)."""
    by_site: dict[int, list[tuple[bytes, bool]]] = defaultdict(list)
    for sites, positions, generated in specs:
        for site in sites:
            by_site[int(site)].append((bytes(positions), bool(generated)))
    grouped: dict[tuple[bytes, bool], list[int]] = defaultdict(list)
    for site, keys in by_site.items():
        if len(set(keys)) == 1:
            grouped[keys[0]].append(site)
        else:
            union = np.concatenate([unpack_positions(p) for p, _ in keys])  # made unique below
            grouped[(union.tobytes(), any(g for _, g in keys))].append(site)
    groups = []
    for (positions, generated), sites in grouped.items():
        positions = np.unique(unpack_positions(positions)).astype(np.int64)  # sorted, once
        lo, hi = (int(positions[0]), int(positions[-1])) if len(positions) else (0, -1)
        groups.append((tuple(sorted(sites)), positions, generated, lo, hi))
    return groups


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
        self._row_slots: np.ndarray | bool = False  # the slots the buffer holds (False: all zero)
        self._steady: tuple | None = None  # (request ids, rows, slot bytes, applied) of a step to repeat
        num_patch = max(len(self.patch_sites), 1)
        self.bank = torch.zeros((int(spec.get("bank_rows", 0)) + 1, self.hidden_size), dtype=self.dtype,
                                device=self.device)
        self.patch_idx = torch.zeros((num_patch, self.max_rows), dtype=torch.int64, device=self.device)
        self.patch_coef = torch.zeros((num_patch, self.max_rows, 2), dtype=torch.float32, device=self.device)
        self.patch_mask = torch.zeros((num_patch, self.max_rows), dtype=torch.bool, device=self.device)
        self._patched_flat: torch.Tensor | None = None  # entries written last step, cleared before the next
        self._patched_host: np.ndarray | None = None  # this step's patch entries ([patch site, row] flat indices)
        self._captured_sites: set[int] = set()  # the sites this step captures or keeps rows at
        # a step run layer by layer (``skipping.run_layers``): the sites whose op has work in it, called directly
        self.direct_sites: frozenset[int] | None = None
        self.bank_rows: dict[str, int] = {}
        self._bank_users: dict[str, int] = {}
        self._released: set[str] = set()
        self._unwritten: set[str] = set()  # kept keys whose values no step has computed yet
        self._keep_dest: tuple | None = None  # this step's kept values: (cap_out rows, bank rows)
        self.keep_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # overflowing step: site -> (rows, bank)
        self._keep_keys: list[np.ndarray] = []  # keys this step writes
        self._free_bank = list(range(self.bank.shape[0] - 1, 0, -1))
        # kept values by (run, site): (positions, keys), and, once all are written, (positions, bank rows); the
        # number of requests whose cells start from them
        self._kept_by_site: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._streams: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._stream_users: dict[tuple[str, int], int] = {}
        self._stream_keys: set[str] = set()  # the keys of the streams with users: never freed under them
        self.pending_scores: list[tuple[int, str, np.ndarray]] = []
        self.staging = PinnedRing(STAGING_BYTES if self.device.type == "cuda" else 0, self.device)
        self._pending: list[tuple] = []  # device-side results not yet read back: ("score" | "capture", ...)
        self._pending_bytes = 0
        self._free_slots = list(range(self.num_slots - 1, 0, -1))
        self._slot_users: dict[tuple, list] = {}  # steer key -> [prefill slot, decode slot, refcount]
        # keys no request uses any more, oldest first: their table rows stay valid until the slots are needed
        self._idle_slot_users: dict[tuple, list] = {}

        self.vectors: dict[str, np.ndarray] = {}
        self.requests: dict[str, RequestPlan | None] = {}  # worker request id -> plan (None: no payload)
        self.capture_index = {site: i for i, site in enumerate(self.capture_sites)}
        num_capture = max(len(self.capture_sites), 1)
        self.cap_src = torch.zeros((num_capture, self.max_rows), dtype=torch.int64, device=self.device)
        self.cap_dest = torch.zeros((num_capture, self.max_rows), dtype=torch.int64, device=self.device)
        self.cap_count = torch.zeros(num_capture, dtype=torch.int32, device=self.device)
        self.cap_out = torch.zeros((self.max_rows if self.capture_sites else 1, self.hidden_size),
                                   dtype=self.dtype, device=self.device)
        self._cap_count_dirty = False
        self.capture_rows: dict[int, torch.Tensor] = {}  # rows copied directly, on steps that overflow cap_out
        self._capture_meta: list[tuple[int, str, np.ndarray, int]] = []  # (site, rid, positions, first out row)
        self._capture_total = 0  # rows of cap_out written this step
        self.captured: list[tuple[int, torch.Tensor]] = []
        self._digest = hashlib.blake2b(digest_size=16)
        self.steps_applied = 0
        self.results: dict[str, dict[int, list[tuple[np.ndarray, np.ndarray]]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self.scores: dict[str, dict] = {}
        self.voided: dict[str, str] = {}
        # a step with packed cells: its attention sequences (``plan_sequences``), and the cells it scores
        self.sequences: dict | None = None
        self.row_of: np.ndarray | None = None  # a step that skips layers: batch row -> row in the model's order
        self.layer_metadata: dict[int, dict[int, object]] = {}  # such a step: builder -> sequences -> metadata
        self._packed: set[str] = set()  # worker ids of the admitted packed requests
        self.cell_scores: tuple[torch.Tensor, list] | None = None
        self.cell_hidden: torch.Tensor | None = None

    # -- the op -------------------------------------------------------------------------------------
    def _steer(self, x: torch.Tensor, site: int) -> torch.Tensor | None:
        """x plus the rows' steering at this site (a fresh tensor), or None where the site does not steer."""
        index = self.steer_index.get(site)
        return None if index is None else kernels.steer_add(x, self.table[index], self.row_slot)

    def _capture(self, site: int, out: torch.Tensor, extra: torch.Tensor | None) -> None:
        if self.direct_sites is not None and site not in self._captured_sites:
            return  # run layer by layer: no launch where the step captures nothing
        if self.capture_rows or self.keep_rows:  # an overflowing step, outside the graphs
            rows = self.capture_rows.get(site)
            if rows is not None:
                self.captured.append((site, gather_rows(out, rows, extra)))
            kept = self.keep_rows.get(site)
            if kept is not None:
                self.bank[kept[1]] = gather_rows(out, kept[0], extra)
            return
        k = self.capture_index.get(site)
        if k is not None:
            n = out.shape[0]
            kernels.capture_rows(out, extra, self.cap_src[k, :n], self.cap_dest[k, :n], self.cap_count[k : k + 1],
                                 self.cap_out)

    def apply_site(self, x: torch.Tensor, extra: torch.Tensor | None, site: int) -> torch.Tensor:
        out = self._steer(x, site)
        p = self.patch_index.get(site)
        if p is not None:  # a single tensor here: the embedding stream or a sub-layer output
            out = kernels.patch_rows(x if out is None else out, self.bank, self.patch_idx[p], self.patch_coef[p],
                                     self.patch_mask[p], out=out)
        elif out is None:
            out = x.clone()  # the op's result may not alias its input
        self._capture(site, out, extra)
        return out

    def apply_pair(self, x: torch.Tensor, extra: torch.Tensor, site: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.patch_index[site]
        steered = self._steer(x, site)
        out, extra = kernels.patch_pair(x if steered is None else steered, extra, self.bank, self.patch_idx[p],
                                        self.patch_coef[p], self.patch_mask[p])
        self._capture(site, out, extra)
        return out, extra

    def step_sites(self) -> frozenset[int]:
        """The sites whose op has work this step (it steers, patches or captures some row); at the others the op
        returns its input's values."""
        sites = set(self._captured_sites)
        if self._patched_host is not None:
            sites |= {self.patch_sites[i] for i in np.unique(self._patched_host // self.max_rows).tolist()}
        if self._row_slots is not False:
            sites = sites | set(self.steer_sites)
        return frozenset(sites)

    # -- vectors and slots --------------------------------------------------------------------------
    def register_vectors(self, vectors: dict[str, bytes]) -> int:
        for key, data in vectors.items():
            vec = np.frombuffer(data, dtype=np.float32)
            if vec.shape != (self.hidden_size,):
                raise ValueError(f"vector {key}: length {vec.size}, model hidden size {self.hidden_size}")
            if key not in self.vectors:
                self._fold(b"vector", np.frombuffer(key.encode(), dtype=np.uint8), vec)
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
            if len(sources[key]) != 4 * self.hidden_size:
                raise ValueError(f"source {key}: length {len(sources[key]) // 4}, model hidden size {self.hidden_size}")
        if new:
            rows = np.array([self._free_bank.pop() for _ in new], dtype=np.int64)
            values = np.frombuffer(b"".join(sources[k] for k in new), dtype=np.float32).reshape(len(new), -1)
            self._fold(b"source", rows, values)
            self.bank[self.staging.upload(rows)] = self.staging.upload(values).to(self.dtype)  # one copy, no wait
            self.bank_rows.update(zip(new, rows.tolist()))
        self._released.difference_update(sources)
        return len(self.bank_rows)

    def release_sources(self, keys: list[str]) -> int:
        """Drop sources now, or when the last admitted request using them finishes."""
        for key in keys:
            if key in self.bank_rows:
                self._released.add(key)
                self._free_source_if_unused(key)
        rows = self.bank_rows
        for stream in [s for s, (_, kept) in self._kept_by_site.items() if any(k not in rows for k in kept.tolist())]:
            del self._kept_by_site[stream]  # no cell can start from it any more
        return len(self.bank_rows)

    def _free_source_if_unused(self, key: str) -> None:
        if key in self._released and not self._bank_users.get(key) and key not in self._stream_keys:
            self._streams.clear()  # a cache of validated streams: this row may be in one
            self._released.discard(key)
            self._unwritten.discard(key)
            self._bank_users.pop(key, None)
            self._free_bank.append(self.bank_rows.pop(key))

    def _reserve_kept(self, plan: RequestPlan, keep: dict) -> None:
        """Bank rows for the values a request keeps, written by the steps that compute them. A key already in the
        bank stays (kept again if it was released) and keeps its row, written only if no step has yet (the same
        computation); with the bank full, a key gets none, and requests that need it are voided."""
        run, reserved, writes = keep["run"], [], []
        rows_in_bank, free = self.bank_rows, self._free_bank
        for sites, positions in keep["groups"]:
            positions = np.unique(unpack_positions(positions)).astype(np.int64)
            if not len(positions):
                continue
            sites = tuple(int(x) for x in sites)
            keys = [ref_key(run, site, p) for site in sites for p in positions.tolist()]
            rows = []
            if len(free) >= len(keys) and all(k not in rows_in_bank for k in keys):  # the usual case: all new
                rows = free[len(free) - len(keys):][::-1]
                del free[len(free) - len(keys):]
                rows_in_bank.update(zip(keys, rows))
                reserved += keys
                writes += keys
                keys_to_check = ()
            else:
                keys_to_check = keys
            for key in keys_to_check:
                row = rows_in_bank.get(key)
                if row is not None:
                    self._released.discard(key)
                    if key in self._unwritten:
                        rows.append(row)
                        writes.append(key)
                    else:
                        rows.append(-1)
                    continue
                if not free:
                    rows.append(-1)
                    continue
                rows_in_bank[key] = row = free.pop()
                rows.append(row)
                reserved.append(key)
                writes.append(key)
            shape = (len(sites), len(positions))
            rows = np.array(rows, dtype=np.int64).reshape(shape)
            keys = np.array(keys, dtype=object).reshape(shape)
            plan.keep.append((sites, positions, int(positions[0]), int(positions[-1]), rows, keys))
            for site, site_keys in zip(sites, keys):
                self._kept_by_site[(run, site)] = (positions, site_keys)
                self._streams.pop((run, site), None)
            self._fold(b"keep", np.array(sites), positions, rows)
        self._unwritten.update(reserved)
        users = self._bank_users
        for key in writes:  # a writer uses its rows: none is freed under it
            users[key] = users.get(key, 0) + 1
        plan.bank_keys += tuple(writes)

    def _acquire_slots(self, steer: list) -> tuple[tuple, int, int]:
        key = tuple(sorted((int(s), int(p), str(k), float(c)) for s, p, k, c in steer))
        users = self._slot_users.get(key)
        if users is None and key in self._idle_slot_users:  # steered again (a sweep's next wave): reuse
            users = self._slot_users[key] = self._idle_slot_users.pop(key)
        if users is None:
            while len(self._free_slots) < 2 and self._idle_slot_users:
                oldest = next(iter(self._idle_slot_users))
                self._free_slots.extend(self._idle_slot_users.pop(oldest)[:2])
            if len(self._free_slots) < 2:
                raise RuntimeError("interp steering table is full")
            missing = [vkey for _, _, vkey, _ in key if vkey not in self.vectors]
            if missing:
                raise KeyError(f"steering vector {missing[0]} was not registered on the worker")
            users = [self._free_slots.pop(), self._free_slots.pop(), 0]
            index = np.array([self.steer_index[site] for site, _, _, _ in key], dtype=np.int64)
            phases = np.array([p for _, p, _, _ in key], dtype=np.int64)
            terms = np.stack([self.vectors[vkey] for _, _, vkey, _ in key]) \
                * np.array([c for _, _, _, c in key], dtype=np.float32)[:, None]
            sums = np.zeros((2, len(self.steer_sites), self.hidden_size), dtype=np.float32)
            for phase_index, phase in enumerate((PREFILL, DECODE)):
                chosen = (phases & phase) != 0
                rows = index[chosen]
                if len(np.unique(rows)) == len(rows):
                    sums[phase_index, rows] = terms[chosen]
                else:  # several terms at one site: summed in key order
                    np.add.at(sums[phase_index], rows, terms[chosen])
            # the values follow from the key and the registered (folded) vectors
            self._fold(b"slots", np.array(users[:2]), np.frombuffer(repr(key).encode(), dtype=np.uint8))
            values = self.staging.upload(sums).to(self.dtype)  # through the ring: no wait for the GPU
            self.table[:, users[0]].copy_(values[0])
            self.table[:, users[1]].copy_(values[1])
            self._slot_users[key] = users
        users[2] += 1
        return key, users[0], users[1]

    def _stream(self, run: str, site: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(positions, bank rows) of the values ``run`` keeps at ``site``, or None unless every one is written."""
        stream = self._streams.get((run, site))
        if stream is None:
            kept = self._kept_by_site.get((run, site))
            if kept is None:
                return None
            positions, keys = kept
            rows = [self.bank_rows.get(key, -1) for key in keys.tolist()]
            if -1 in rows or not self._unwritten.isdisjoint(keys.tolist()):
                return None
            stream = self._streams[(run, site)] = (positions, np.array(rows, dtype=np.int64))
        return stream

    def _release(self, plan: RequestPlan) -> None:
        for key in plan.bank_keys:
            self._bank_users[key] -= 1
            self._free_source_if_unused(key)
        for stream in plan.streams:
            self._stream_users[stream] -= 1
            if not self._stream_users[stream]:
                del self._stream_users[stream]
                kept = self._kept_by_site.get(stream)
                keys = kept[1].tolist() if kept is not None else ()
                self._stream_keys.difference_update(keys)
                for key in keys:
                    self._free_source_if_unused(key)
        if plan.steer_key is None:
            return
        users = self._slot_users[plan.steer_key]
        users[2] -= 1
        if users[2] == 0:
            self._idle_slot_users[plan.steer_key] = self._slot_users.pop(plan.steer_key)

    # -- per step -----------------------------------------------------------------------------------
    def _admit(self, request) -> RequestPlan | None:
        extra = request.sampling_params.extra_args if request.sampling_params else None
        payload = (extra or {}).get(PAYLOAD_KEY)
        if payload is None:
            return None
        plan = RequestPlan(rid=payload["rid"], prompt_len=request.num_prompt_tokens)
        if payload.get("steer"):
            plan.steer_key, plan.prefill_slot, plan.decode_slot = self._acquire_slots(payload["steer"])
        if payload.get("capture"):
            plan.capture_groups = capture_groups(payload["capture"])
        if payload.get("keep"):
            self._reserve_kept(plan, payload["keep"])
        if payload.get("score") is not None:
            plan.score_ids = unpack_positions(payload["score"]).astype(np.int64)
        if payload.get("patch"):
            self._admit_patch(plan, payload["patch"])
        cells = payload.get("cells")
        if cells is not None:
            scored: dict[bytes, np.ndarray] = {}  # cells of one fact score the same token ids
            for ids in cells["score"]:
                if ids not in scored:
                    scored[ids] = unpack_positions(ids).astype(np.int64)
            plan.cells = CellLayout(int(cells["prefix"]), int(cells["stride"]), int(cells["length"]),
                                    list(cells["rids"]), [scored[ids] for ids in cells["score"]])
            if cells.get("start") and plan.void is None:
                self._admit_starts(plan, cells["start"])
            if plan.void is not None:
                self.voided.pop(plan.rid, None)
                for rid in plan.cells.rids:
                    self.voided[rid] = plan.void
        return plan

    def _plans(self, runner) -> list[RequestPlan | None]:
        """The plans of the step's requests, in batch order (new requests admitted)."""
        req_ids = runner.input_batch.req_ids[: runner.input_batch.num_reqs]
        self.forget_finished(runner.requests)
        for rid in req_ids:
            if rid not in self.requests:
                plan = self.requests[rid] = self._admit(runner.requests[rid])
                if plan is not None and plan.cells is not None:
                    self._packed.add(rid)
        return [self.requests[rid] for rid in req_ids]

    def _admit_starts(self, plan: RequestPlan, starts: list) -> None:
        """Each cell's first layer and the bank rows of the stream its segment starts from there."""
        cells = plan.cells
        distinct: dict[tuple, int] = {}  # (layer, run) -> its index (cells of a request share a few)
        which = np.array([distinct.setdefault((int(s[0]), s[1]), len(distinct)) if s else -1 for s in starts],
                         dtype=np.int64)
        layers = np.zeros(len(distinct) + 1, dtype=np.int64)  # the last: cells that start at the bottom
        table = np.zeros((len(distinct) + 1, cells.stride), dtype=np.int64)
        segment = []  # the streams read: (run, site)
        for (layer, run), i in distinct.items():
            key = (run, site_id(layer, "pre_attn"))
            stream, rows = self._stream(*key), None
            if stream is not None:
                positions, bank = stream
                a = int(np.searchsorted(positions, cells.prefix))
                if a + cells.length <= len(positions) and positions[a + cells.length - 1] == \
                        cells.prefix + cells.length - 1 and positions[a] == cells.prefix:
                    rows = bank[a : a + cells.length]
            if rows is None:
                plan.void = f"the residual stream its cells start from is not on the worker ({run}, layer {layer})"
                return
            layers[i] = layer
            table[i, : cells.length] = rows
            segment.append(key)
        first, inject = layers[which], table[which]
        cells.start, cells.inject = first, inject
        plan.streams = tuple(segment)
        for key in segment:
            users = self._stream_users.get(key, 0)
            if not users:
                self._stream_keys.update(self._kept_by_site[key][1].tolist())
            self._stream_users[key] = users + 1
        self._fold(b"start", first, inject)

    def _admit_patch(self, plan: RequestPlan, patch: dict) -> None:
        keys = patch["src"]
        rows = self.bank_rows
        missing = sorted({k for k in keys if k not in rows or k in self._unwritten})
        if missing:  # never run it as if patched: it is reported void
            plan.void = f"{len(missing)} patch source(s) not on the worker, e.g. {missing[0]}"
            self.voided[plan.rid] = plan.void
            return
        # a few entries per request: plain lists (a step gathers them into one array each)
        sites = memoryview(patch["site"]).cast("i").tolist()
        positions = memoryview(patch["pos"]).cast("i").tolist()
        a, b = memoryview(patch["a"]).cast("f").tolist(), memoryview(patch["b"]).cast("f").tolist()
        banks = [rows[k] for k in keys]
        ordered = list(zip(positions, sites))
        if any(x >= y for x, y in zip(ordered, ordered[1:])):
            # one entry per (site, position), a later entry winning; sorted by position, then site
            last = {key: i for i, key in enumerate(ordered)}
            keep = sorted(last.values(), key=ordered.__getitem__)
            sites, positions = [sites[i] for i in keep], [positions[i] for i in keep]
            a, b, banks = [a[i] for i in keep], [b[i] for i in keep], [banks[i] for i in keep]
        lookup = self.patch_index  # a site the engine lacks raises KeyError
        # the flat index into [patch site, row] is base + (the request's first row in a step - its first position)
        base = [lookup[site] * self.max_rows + position for site, position in zip(sites, positions)]
        plan.patch = (positions, base, banks, a, b)
        plan.patch_span = (positions[0], positions[-1])
        used = tuple(set(keys))
        plan.bank_keys += used
        for key in used:
            self._bank_users[key] = self._bank_users.get(key, 0) + 1

    def forget_finished(self, live_requests) -> None:
        for rid in [r for r in self.requests if r not in live_requests]:
            self._packed.discard(rid)
            plan = self.requests.pop(rid)
            if plan is not None:
                self._release(plan)

    def before_forward(self, runner, num_rows: int) -> bool:
        """Fill this step's buffers; returns whether this step captures."""
        batch = runner.input_batch
        n = batch.num_reqs
        req_ids = batch.req_ids[:n]
        steady, self._steady = self._steady, None
        if steady is not None and num_rows == steady[1] and runner.query_start_loc.np[n] == n \
                and steady[0] == tuple(req_ids):
            # the same requests, one generated token each, nothing but steering (or nothing) left to apply:
            # the buffers already hold this step
            self.steps_applied += steady[3]
            if steady[2] is not None:
                self._fold(b"steer", steady[2])
            self.pending_scores = []
            self._steady = steady
            return False
        plans = self._plans(runner)
        self.pending_scores = []
        if not any(plans):
            if self._row_slots is not False:
                self.row_slot.zero_()
                self._row_slots = False
            self._plan_patches([], None, None)
            captures = self._plan_captures([], None, None)
            if runner.query_start_loc.np[n] == n:
                self._steady = (tuple(req_ids), num_rows, None, False)
            return captures

        starts = runner.query_start_loc.np[: n + 1].astype(np.int64)
        computed = batch.num_computed_tokens_cpu[:n].astype(np.int64)
        self.steps_applied += 1
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
            if self.row_of is not None:
                slots[self.row_of] = slots[:num_tokens].copy()
            if isinstance(self._row_slots, np.ndarray) and np.array_equal(self._row_slots, slots):
                pass  # the buffer already holds these slots (steady decode of the same batch)
            else:
                self.staging.upload(slots, into=self.row_slot[:num_rows])
            self._row_slots = slots
            self._fold(b"steer", slots[:num_tokens])
        elif self._row_slots is not False:
            self.row_slot.zero_()
            self._row_slots = False

        captures = self._plan_captures(plans, starts, computed)
        if num_tokens == n and self._repeats_next_step(plans, computed, captures):
            steer = self._row_slots[:n].tobytes() if isinstance(self._row_slots, np.ndarray) else None
            self._steady = (tuple(req_ids), num_rows, steer, True)
        return captures

    def _repeats_next_step(self, plans, computed, captures: bool) -> bool:
        """Whether a next step of the same requests, one generated token each, needs exactly this step's
        buffers: every row already a generated token (decode slots), no scores, patches or captures now or
        later."""
        if captures or self._capture_meta or self._patched_flat is not None or self.pending_scores:
            return False
        for plan, done in zip(plans, computed.tolist()):
            if plan is None:
                continue
            if done < plan.prompt_len:
                return False
            if plan.patch is not None and plan.patch_span[1] >= done:
                return False
            for _, _, generated, _, hi in plan.capture_groups:
                if generated or hi >= done:
                    return False
            if any(hi >= done for _, _, _, hi, _, _ in plan.keep):
                return False
        return True

    def _plan_captures(self, plans, starts, computed) -> bool:
        """Point each capture site at this step's rows (those captured for the host, then those kept in the bank);
        returns whether the step must run outside the graphs (its rows do not fit ``cap_out``: they are then
        copied out directly)."""
        rows_by_site: dict[int, list[np.ndarray]] = defaultdict(list)
        keep_by_site: dict[int, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)  # (rows, bank rows)
        kept_keys: list[np.ndarray] = []
        meta: list[tuple[int, str, np.ndarray, int]] = []
        total = 0
        for i, plan in enumerate(plans):
            if plan is None or not (plan.capture_groups or plan.keep):
                continue
            first, count = int(computed[i]), int(starts[i + 1] - starts[i])
            end = first + count
            for sites, prompt_positions, generated, lo, hi in plan.capture_groups:
                if not generated and (first > hi or end <= lo):
                    continue  # nothing of this group in the step's rows
                a, b = np.searchsorted(prompt_positions, (first, end))
                chosen = prompt_positions[a:b]
                if generated and end > plan.prompt_len:
                    chosen = np.union1d(chosen, np.arange(max(first, plan.prompt_len), end))
                if not len(chosen):
                    continue
                rows = chosen - first + starts[i]
                if self.row_of is not None:
                    rows = self.row_of[rows]
                for site in sites:
                    rows_by_site[site].append(rows)
                    meta.append((site, plan.rid, chosen, -1))
                    total += len(rows)
            for sites, positions, lo, hi, bank, keys in plan.keep:
                if first > hi or end <= lo:
                    continue
                a, b = np.searchsorted(positions, (first, end))
                rows = positions[a:b] - first + starts[i]
                if self.row_of is not None:
                    rows = self.row_of[rows]
                for j, site in enumerate(sites):
                    dest, named = bank[j, a:b], keys[j, a:b]
                    wanted = dest >= 0
                    if not wanted.all():
                        dest, named, site_rows = dest[wanted], named[wanted], rows[wanted]
                    else:
                        site_rows = rows
                    if len(dest):
                        keep_by_site[site].append((site_rows, dest))
                        kept_keys.append(named)
                        total += len(dest)
        self.capture_rows, self.keep_rows, self._keep_dest, self._keep_keys = {}, {}, None, kept_keys
        self._captured_sites = rows_by_site.keys() | keep_by_site.keys()
        if self._cap_count_dirty:
            self.cap_count.zero_()
            self._cap_count_dirty = False
        self._capture_meta = []
        if not rows_by_site and not keep_by_site:
            return False
        if total > self.cap_out.shape[0]:
            device_rows: dict[bytes, torch.Tensor] = {}
            for site, parts in rows_by_site.items():
                rows = np.concatenate(parts)
                key = rows.tobytes()
                if key not in device_rows:
                    device_rows[key] = self.staging.upload(rows)
                self.capture_rows[site] = device_rows[key]
            for site, parts in keep_by_site.items():
                rows, dest = np.concatenate([r for r, _ in parts]), np.concatenate([d for _, d in parts])
                self.keep_rows[site] = (self.staging.upload(rows), self.staging.upload(dest))
                self._fold(b"keep-direct", rows, dest)
            self._capture_meta = meta  # read in the order the sites' gathers append (see after_forward)
            self._fold(b"capture-direct", *(r for parts in rows_by_site.values() for r in parts))
            return True
        # cap_out: the rows for the host first, in site order, each site's rows in the order of its requests; then
        # the kept rows the host's do not hold already, in site order (a site copies a row once: at most the
        # step's rows)
        host_total = sum(len(r) for parts in rows_by_site.values() for r in parts)
        flat_index, src, dest, keep_from, keep_to = [], [], [], [], []
        counts = np.zeros(self.cap_count.shape[0], dtype=np.int32)
        first_row, offset, kept_offset = {}, 0, host_total
        for site in sorted(rows_by_site.keys() | keep_by_site.keys()):
            k = self.capture_index[site]
            host = rows_by_site.get(site)
            host = np.concatenate(host) if host else np.zeros(0, dtype=np.int64)
            new = np.zeros(0, dtype=np.int64)
            kept = keep_by_site.get(site)
            if kept:
                rows, bank = np.concatenate([r for r, _ in kept]), np.concatenate([d for _, d in kept])
                at = np.full(len(rows), -1, dtype=np.int64)  # the cap_out row holding it already
                if len(host):
                    order = np.argsort(host)
                    i = np.minimum(np.searchsorted(host, rows, sorter=order), len(host) - 1)
                    found = host[order[i]] == rows
                    at[found] = offset + order[i[found]]
                fresh = at < 0
                new = rows[fresh]
                at[fresh] = np.arange(kept_offset, kept_offset + len(new))
                keep_from.append(at)
                keep_to.append(bank)
            counts[k] = len(host) + len(new)
            flat_index.append(k * self.max_rows + np.arange(counts[k]))
            src += [host, new]
            dest += [np.arange(offset, offset + len(host)), np.arange(kept_offset, kept_offset + len(new))]
            first_row[site] = offset
            offset += len(host)
            kept_offset += len(new)
        for site, rid, chosen, _ in meta:
            self._capture_meta.append((site, rid, chosen, first_row[site]))
            first_row[site] += len(chosen)
        flat = self.staging.upload(np.concatenate(flat_index))
        self.cap_src.view(-1)[flat] = self.staging.upload(np.concatenate(src))
        self.cap_dest.view(-1)[flat] = self.staging.upload(np.concatenate(dest))
        self.staging.upload(counts, into=self.cap_count)
        self._cap_count_dirty = True
        self._capture_total = host_total
        if keep_to:
            keep_from, keep_to = np.concatenate(keep_from), np.concatenate(keep_to)
            self._keep_dest = (self.staging.upload(keep_from), self.staging.upload(keep_to))
            self._fold(b"keep", keep_from, keep_to)
        self._fold(b"capture", counts, *src)
        return False

    def _plan_patches(self, plans, starts, computed) -> None:
        """Point this step's patched rows at their bank rows; rows patched last step are unmasked first."""
        flat, banks, a, b = [], [], [], []
        if any(p is not None and p.patch is not None for p in plans):
            starts, computed = starts.tolist(), computed.tolist()
            for i, plan in enumerate(plans):
                if plan is None or plan.patch is None:
                    continue
                positions, base, bank, pa, pb = plan.patch
                first, (lo, hi) = computed[i], plan.patch_span
                end = first + starts[i + 1] - starts[i]
                if hi < first or lo >= end:
                    continue
                j, k = 0, len(positions)
                if first > lo or end <= hi:  # part of the prompt in this step
                    j, k = bisect_left(positions, first), bisect_left(positions, end)
                shift = starts[i] - first
                flat += [x + shift for x in base[j:k]]
                banks += bank[j:k]
                a += pa[j:k]
                b += pb[j:k]
        mask = self.patch_mask.view(-1)
        if self._patched_flat is not None:
            mask[self._patched_flat] = False
            self._patched_flat = None
        self._patched_host = None
        if not flat:
            return
        flat, banks = np.array(flat, dtype=np.int64), np.array(banks, dtype=np.int64)
        self._patched_host = flat
        if self.row_of is not None:
            site, row = np.divmod(flat, self.max_rows)
            flat = site * self.max_rows + self.row_of[row]
        coef = np.array([a, b], dtype=np.float32).T.copy()
        device_flat = self.staging.upload(flat)
        self.patch_idx.view(-1)[device_flat] = self.staging.upload(banks)
        self.patch_coef.view(-1, 2)[device_flat] = self.staging.upload(coef)
        mask[device_flat] = True
        self._patched_flat = device_flat
        self._fold(b"patch", flat, banks, coef)

    def plan_sequences(self, runner) -> None:
        """A step with packed cells: split each packed request into attention sequences (the prefix, then one
        per cell segment, each seeing the prefix's blocks and its own), put the segments' tokens at the positions
        of the prompt they stand for, and mark each cell's last prompt token for scoring. Other requests stay one
        sequence each; nothing changes in a step without packed cells."""
        self.sequences, self.cell_scores, self.row_of = None, None, None
        requests, packed, batch = self.requests, self._packed, runner.input_batch
        if not any(rid not in requests or rid in packed for rid in batch.req_ids[: batch.num_reqs]):
            return  # the usual step (a decode step, say): every request admitted, none packed
        plans = self._plans(runner)
        if not any(p is not None and p.cells is not None for p in plans):
            return
        batch = runner.input_batch
        n = batch.num_reqs
        starts = runner.query_start_loc.np[: n + 1].astype(np.int64)
        computed = batch.num_computed_tokens_cpu[:n].astype(np.int64)
        block = runner.cache_config.block_size
        # per request, its sequences: (query starts, query lengths, sequence lengths, token shifts, first shifted
        # block, first layer, tokens before a segment's padding); a request that is not packed is one sequence
        parts, part_owner = [], []
        score_rows, score_meta = [], []
        inject_rows, inject_at = [], []  # cells that skip layers: bank rows of their tokens' stream, first row
        for i, plan in enumerate(plans):
            first, count = int(computed[i]), int(starts[i + 1] - starts[i])
            end = first + count
            cells = plan.cells if plan is not None else None
            if cells is None or end <= cells.prefix:
                parts.append(([starts[i]], [count], [end], [0], [0], [0], [count]))
                part_owner.append(i)
                continue
            p, stride = cells.prefix, cells.stride
            if first < p:
                parts.append(([starts[i]], [p - first], [p], [0], [0], [0], [p - first]))
                part_owner.append(i)
            lo = max(first, p)
            k = np.arange((lo - p) // stride, (end - 1 - p) // stride + 1)
            seg_lo = np.maximum(lo, p + k * stride)
            seg_hi = np.minimum(end, p + (k + 1) * stride)
            shift = k * stride
            parts.append((starts[i] + seg_lo - first, seg_hi - seg_lo, seg_hi - shift, shift,
                          np.full(len(k), p // block), cells.start[k] if cells.start is not None else np.zeros_like(k),
                          np.clip(p + shift + cells.length - seg_lo, 0, seg_hi - seg_lo)))
            part_owner.append(i)
            if cells.start is not None:
                own = seg_lo - p - shift  # the first of each segment's tokens in this step, as a segment offset
                lens = seg_hi - seg_lo
                at = np.repeat(own - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
                inject_rows.append(cells.inject[np.repeat(k, lens), at])
                inject_at.append(starts[i] + lo - first)
            last = p + shift + cells.length - 1
            hit = (last >= seg_lo) & (last < seg_hi)
            score_rows.append(starts[i] + last[hit] - first)
            score_meta += [(cells.rids[j], cells.score_ids[j]) for j in k[hit].tolist()]
        q_start, q_len, seq_len, shift, from_block, first_layer, live = (
            np.concatenate([np.asarray(part[f], dtype=np.int64) for part in parts]) for f in range(7))
        owner = np.repeat(np.array(part_owner), [len(part[1]) for part in parts])
        self._fold(b"sequences", q_start, q_len, seq_len, shift, first_layer)
        num_tokens = int(starts[n])
        positions = np.repeat(seq_len - q_len - q_start, q_len) + np.arange(num_tokens)
        skip = None
        if not live.any():  # a step of nothing but padding: computed as it is
            live = q_len
        if first_layer.any() or (live < q_len).any():
            # the model runs the sequences in order of their first layer, so a layer's rows are a prefix of them;
            # segments' padding is never computed (no token of theirs reads it): its rows come last, in no layer
            inject = np.zeros(num_tokens, dtype=np.int64)
            for rows, at in zip(inject_rows, inject_at):
                inject[at : at + len(rows)] = rows
            order = np.argsort(first_layer, kind="stable")
            order = order[live[order] > 0]
            dead = np.flatnonzero(np.arange(num_tokens) - np.repeat(q_start, q_len) >= np.repeat(live, q_len))
            seq_len = seq_len - (q_len - live)
            q_len, seq_len, shift, from_block, first_layer, owner = (
                x[order] for x in (live, seq_len, shift, from_block, first_layer, owner))
            old_start, q_start = q_start[order], np.zeros(len(order), dtype=np.int64)
            np.cumsum(q_len[:-1], out=q_start[1:])
            computed_rows = int(q_len.sum())
            perm = np.concatenate([np.repeat(old_start - q_start, q_len) + np.arange(computed_rows), dead])
            self.row_of = np.empty(num_tokens, dtype=np.int64)  # model row of each batch row
            self.row_of[perm] = np.arange(num_tokens)
            token_layer = np.repeat(first_layer, q_len)
            layers = np.arange(int(first_layer[-1]) + 1)
            num_first = int(np.searchsorted(token_layer, 0, side="right"))
            skip = {
                "perm": self.staging.upload(perm[:computed_rows]),  # model row -> batch row, computed rows
                "rows": np.searchsorted(token_layer, layers, side="right").tolist(),  # a layer's rows
                "seqs": np.searchsorted(first_layer, layers, side="right").tolist(),  # its sequences
                "inject": self.staging.upload(inject[perm[num_first:computed_rows]]),
            }
            positions = positions[perm]
            self._fold(b"skip", perm, inject)
        num_seqs = len(q_len)
        width = int((-(-seq_len // block)).max())
        cols = np.arange(width)[None, :]
        cols = cols + np.where(cols >= from_block[:, None], (shift // block)[:, None], 0)
        table = batch.block_table[0].get_device_tensor(n)
        cols = np.minimum(cols, table.shape[1] - 1)
        query_start = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(q_len, out=query_start[1:])
        prompt_len = batch.num_prompt_tokens[:n].astype(np.int64)
        self.sequences = {
            "num_tokens": num_tokens,
            "query_start_loc": self.staging.upload(query_start),
            "query_start_loc_cpu": torch.from_numpy(query_start),
            "seq_lens": self.staging.upload(seq_len.astype(np.int32)),
            "seq_lens_cpu": torch.from_numpy(seq_len.astype(np.int32)),
            "computed_cpu": torch.from_numpy((seq_len - q_len).astype(np.int32)),
            "num_reqs": num_seqs,
            "max_query_len": int(q_len.max()),
            "max_seq_len": int(seq_len.max()),
            "block_table": table[self.staging.upload(owner)[:, None], self.staging.upload(cols)],
            "is_prefilling": torch.from_numpy(seq_len - q_len < prompt_len[owner]),
            "skip": skip,
        }
        runner.positions[:num_tokens].copy_(self.staging.upload(positions))
        if score_rows:
            self.cell_scores = (self.staging.upload(np.concatenate(score_rows)), score_meta)

    def record_scores(self, logits: torch.Tensor) -> None:
        """Log-probabilities of each scored request's token ids (any rank), and its top token. Computed on the
        device and kept there: the step does not wait for them (they are read back in bulk)."""
        pending, self.pending_scores = self.pending_scores, []
        if not self.is_result_rank:
            return
        rows = self.staging.upload(np.array([i for i, _, _ in pending], dtype=np.int64))
        self._hold_scores(logits.index_select(0, rows), [(rid, tokens) for _, rid, tokens in pending])

    def record_cell_scores(self, logits: torch.Tensor) -> None:
        """Scores of the packed cells whose last prompt token this step computed (``logits``: one row each)."""
        _, meta = self.cell_scores
        self.cell_scores = None
        if self.is_result_rank:
            self._hold_scores(logits, meta)

    def _hold_scores(self, logits: torch.Tensor, meta: list[tuple[str, np.ndarray]]) -> None:
        """Keep, per (request id, scored token ids) of ``meta``, its row of ``logits``' scores."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top_lp, top_id = logprobs.max(dim=-1)
        width = max(len(ids) for _, ids in meta)
        ids = np.zeros((len(meta), width), dtype=np.int64)
        for j, (_, tokens) in enumerate(meta):
            ids[j, : len(tokens)] = tokens
        chosen = logprobs.gather(1, self.staging.upload(ids))
        self._hold("score", (chosen, top_lp, top_id), meta)

    def _hold(self, kind: str, tensors: tuple, meta: list) -> None:
        """Hold a step's results on the device (copies: the buffers they come from are rewritten next step);
        read them back once enough have gathered, or when results are collected."""
        tensors = tuple(t.clone() for t in tensors)
        self._pending.append((kind, tensors, meta))
        self._pending_bytes += sum(t.numel() * t.element_size() for t in tensors)
        if self._pending_bytes > PENDING_BYTES:
            self._read_back()

    def _read_back(self) -> None:
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        for kind, tensors, meta in pending:
            if kind == "score":
                chosen, top_lp, top_id = (t.cpu().numpy() for t in tensors)
                chosen = chosen.astype(np.float32, copy=False)
                as_int32: dict[int, np.ndarray] = {}  # cells of one fact share their token ids
                for j, ((rid, tokens), lp, top) in enumerate(zip(meta, top_lp.tolist(), top_id.tolist())):
                    ids = as_int32.get(id(tokens))
                    if ids is None:
                        ids = as_int32[id(tokens)] = tokens.astype(np.int32)
                    self.scores[rid] = {"token_ids": ids, "logprobs": chosen[j, : len(ids)], "top_id": top,
                                        "top_logprob": lp}
            else:
                values = tensors[0].float().cpu().numpy()
                for site, rid, chosen, offset in meta:
                    self.results[rid][site].append((chosen, values[offset : offset + len(chosen)]))

    def after_forward(self) -> None:
        """Keep this step's captured rows (copied on the device; read back in bulk by ``_read_back``); copy its
        kept rows into the bank, whose keys then count as registered."""
        if self._keep_dest is not None:
            rows, bank_rows = self._keep_dest
            self.bank[bank_rows] = self.cap_out[rows]
            self._keep_dest = None
        self.keep_rows = {}
        for keys in self._keep_keys:
            self._unwritten.difference_update(keys.tolist())
        self._keep_keys = []
        if self.capture_rows:  # an overflowing step: its gathers were appended in site order
            captured, self.captured, self.capture_rows = self.captured, [], {}
            if self.is_result_rank and captured:
                values = torch.cat([t for _, t in captured])
                meta, offset = [], 0
                by_site = defaultdict(list)
                for site, rid, chosen, _ in self._capture_meta:
                    by_site[site].append((rid, chosen))
                for site, _ in captured:
                    for rid, chosen in by_site[site]:
                        meta.append((site, rid, chosen, offset))
                        offset += len(chosen)
                self._hold("capture", (values,), meta)
        elif self._capture_meta and self.is_result_rank:
            self._hold("capture", (self.cap_out[: self._capture_total],), self._capture_meta)
        self._capture_meta = []

    # -- the checksum of what was applied -------------------------------------------------------------
    def _fold(self, tag: bytes, *arrays) -> None:
        self._digest.update(tag)
        for a in arrays:
            self._digest.update(np.ascontiguousarray(a).tobytes())

    def checksum(self) -> dict:
        return {"digest": self._digest.hexdigest(), "steps": self.steps_applied}

    def collect(self, rids: list[str]) -> dict[str, dict]:
        """Per finished request: ``captures`` (site -> (positions, values); later rows win), ``score`` and
        ``void`` (why its patches could not be applied)."""
        self._read_back()
        out = {}
        for rid in rids:
            per_site = self.results.pop(rid, {})
            merged = {}
            for site, chunks in per_site.items():
                if len(chunks) == 1:  # the usual case: one step's rows, unique positions
                    positions, values = chunks[0]
                    merged[site] = (positions.astype(np.int32), values)
                    continue
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
    """Wrap the model's compute_logits (outside the compiled graph) so scoring steps read their logits; packed
    cells' logits are computed here too, from their rows of the step's hidden states."""
    original = model.compute_logits

    def compute_logits(hidden_states, *args, **kwargs):
        logits = original(hidden_states, *args, **kwargs)
        if state.pending_scores and logits is not None:
            state.record_scores(logits)
        if state.cell_hidden is not None:
            cells, state.cell_hidden = original(state.cell_hidden), None
            if cells is not None:
                state.record_cell_scores(cells)
        return logits

    model.compute_logits = compute_logits


def _packed_sequences(builder, state: InterpState) -> None:
    """Make an attention metadata builder see a packed step's sequences instead of its requests."""
    if "build" in builder.__dict__:
        return
    original = builder.build

    def build(common_prefix_len, common_attn_metadata, *args, **kwargs):
        seqs = state.sequences
        if seqs is None:
            return original(common_prefix_len, common_attn_metadata, *args, **kwargs)
        common_attn_metadata = common_attn_metadata.replace(
            query_start_loc=seqs["query_start_loc"], query_start_loc_cpu=seqs["query_start_loc_cpu"],
            seq_lens=seqs["seq_lens"], _seq_lens_cpu=seqs["seq_lens_cpu"], seq_lens_cpu_upper_bound=seqs["seq_lens_cpu"],
            _num_computed_tokens_cpu=seqs["computed_cpu"], num_reqs=seqs["num_reqs"],
            max_query_len=seqs["max_query_len"], max_seq_len=seqs["max_seq_len"],
            block_table_tensor=seqs["block_table"], is_prefilling=seqs["is_prefilling"],
        )
        # no cascade over the requests' common prefix; no ahead-of-time schedule (its buffer is sized for
        # max_num_seqs sequences)
        kwargs["fast_build"] = True
        if seqs["skip"] is None:
            return original(0, common_attn_metadata, *args, **kwargs)
        variants = state.layer_metadata[id(builder)] = skipping.metadata_by_sequences(
            lambda common: original(0, common, *args, **kwargs), common_attn_metadata, seqs["skip"], seqs["num_reqs"])
        return variants[seqs["num_reqs"]]

    builder.build = build


def instrument_model_runner() -> None:
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if "_interp_original_model_forward" in GPUModelRunner.__dict__:
        return
    original = GPUModelRunner._model_forward
    original_prepare = GPUModelRunner._prepare_inputs
    GPUModelRunner._interp_original_model_forward = original

    def _prepare_inputs(self, *args, **kwargs):
        out = original_prepare(self, *args, **kwargs)
        state = _state_of(self)
        if state is not None:
            state.plan_sequences(self)
            if state.sequences is not None:
                if len(self.attn_groups) != 1:
                    raise RuntimeError("interp: packed cells need a model with one KV-cache group")
                for group in self.attn_groups[0]:
                    for builder in group.metadata_builders:
                        _packed_sequences(builder, state)
        return out

    def _model_forward(self, *args, **kwargs):
        global _active
        state = _state_of(self)
        if state is None:
            return original(self, *args, **kwargs)
        _active = state
        positions = kwargs.get("positions")
        if state.before_forward(self, positions.shape[-1]) or state.sequences is not None:
            context = get_forward_context()
            context.cudagraph_runtime_mode = CUDAGraphMode.NONE
        try:
            if state.sequences is not None and state.sequences["skip"] is not None:
                output = skipping.run_layers(self, state, kwargs["input_ids"], positions)
            else:
                output = original(self, *args, **kwargs)
            if state.cell_scores is not None:
                state.cell_hidden = output.index_select(0, state.cell_scores[0])
            return output
        finally:
            state.sequences, state.row_of = None, None
            state.layer_metadata = {}
            state.after_forward()

    GPUModelRunner._prepare_inputs = _prepare_inputs
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

    def interp_checksum(self) -> dict:
        return self._interp().checksum()

    def interp_collect(self, rids: list[str], packed: bool = True) -> dict:
        """Results of finished requests; ``packed`` for callers in another process (arrays do not survive
        ``collective_rpc`` from worker processes as arrays)."""
        state = self._interp()
        if not state.is_result_rank:
            return {}
        results = state.collect(rids)
        return pack_results(results) if packed else results
