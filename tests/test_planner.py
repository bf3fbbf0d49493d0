"""The plugin's step planner (``InterpState``) on stand-in runners: rows of steering, patches and captures per step,
steering slots, bank rows, prefix-cache placeholders and kept KV (the site ops themselves: ``test_site_ops``)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from support import planner as stand_in


def test_planner_rows_follow_tiers_and_batch_changes_including_repeated_decode_steps():
    """Per step, each row's steering at each site equals the sum of the tiers that apply to its position
    (computed here from the payloads), whether the step was planned afresh or repeated the previous step's
    buffers (same requests decoding); the checksum is the same as with every step planned afresh."""
    import contextlib
    from unittest import mock

    import numpy as np

    from interp_runner.contracts import DECODE, PREFILL, Capture, RequestPayload, Steer
    from interp_runner.payload import pack_positions
    from interp_runner.plugin.runtime import InterpState

    hidden, sites = 16, (4, 9)
    rng = np.random.default_rng(1)
    vectors = {f"v{i}": rng.standard_normal(hidden).astype(np.float32) for i in range(3)}
    payloads = {  # request -> (prompt length, payload or None)
        "A": (5, RequestPayload("A", steer=(Steer(4, PREFILL | DECODE, "v0", 2.0), Steer(9, DECODE, "v1", 1.0)))),
        "B": (3, None),
        "C": (6, RequestPayload("C", steer=(Steer(9, PREFILL, "v2", -1.0), Steer(9, DECODE, "v0", 0.5)))),
        "D": (4, RequestPayload("D", capture=(Capture((4,), pack_positions([3]), False),))),
    }
    # each step: (request, first position, rows) in batch order
    schedule = [[("A", 0, 5), ("B", 0, 3)]] + [[("A", 5 + s, 1), ("B", 3 + s, 1)] for s in range(3)]
    # C's prompt in chunks of 4, 1 and 1 rows: its last prompt tokens come in steps of one row per request
    schedule += [[("A", 8, 1), ("B", 6, 1), ("C", 0, 4)]] + [[("A", 9 + s, 1), ("B", 7 + s, 1), ("C", 4 + s, 1)]
                                                             for s in range(5)]
    schedule += [[("A", 14, 1), ("C", 9, 1)], [("C", 10, 1), ("A", 15, 1)]]  # B finished; the batch reordered
    schedule += [[("A", 16, 1), ("C", 11, 1), ("D", 0, 4)]] + [[("A", 17 + s, 1), ("C", 12 + s, 1), ("D", 4 + s, 1)]
                                                                for s in range(3)]

    def expected(rid, position, site):
        prompt_len, payload = payloads[rid]
        phase = PREFILL if position < prompt_len else DECODE
        total = np.zeros(hidden, np.float32)
        for term in payload.steer if payload is not None else ():
            if term.site == site and term.phases & phase:
                total += np.float32(term.scale) * vectors[term.vector]
        return total

    def run(fresh_every_step: bool):
        state = stand_in.planner(hidden, sites)
        state.register_vectors({k: v.tobytes() for k, v in vectors.items()})
        requests = {rid: stand_in.request(p, n) for rid, (n, p) in payloads.items()}
        planned_steps = []
        forget = InterpState.forget_finished  # skipped by a repeated step
        with mock.patch.object(InterpState, "_repeats_next_step", lambda *a: False) if fresh_every_step \
                else contextlib.nullcontext(), \
                mock.patch.object(InterpState, "forget_finished",
                                  lambda self, live: planned_steps.append(1) or forget(self, live)):
            for index, step in enumerate(schedule):
                finished = {"B"} if index >= 10 else set()
                live = {r: v for r, v in requests.items() if r not in finished}
                state.before_forward(stand_in.runner(live, step), sum(rows for _, _, rows in step))
                slots = state.steering.row_slot.numpy()
                row = 0
                for rid, first, count in step:
                    for position in range(first, first + count):
                        for k, site in enumerate(sites):
                            got = state.steering.table[k, slots[row]].numpy()
                            np.testing.assert_array_equal(got, expected(rid, position, site),
                                                          err_msg=f"{rid} position {position} site {site}")
                        row += 1
                state.after_forward()
        return state.checksum(), len(schedule) - len(planned_steps), state

    planned, repeats_none, _ = run(fresh_every_step=True)
    repeated_run, repeats, state = run(fresh_every_step=False)
    assert repeats_none == 0 and repeats >= 6  # the steady decode steps reused their buffers
    assert repeated_run == planned
    state.before_forward(stand_in.runner({}, []), 0)
    assert state.collect(["D"])["D"]["captures"][4][0].tolist() == [3]  # the capture still ran


def test_steering_slots_are_kept_for_the_next_wave_and_evicted_when_the_table_fills():
    import numpy as np

    from interp_runner.contracts import DECODE, PREFILL, RequestPayload, Steer

    hidden, site = 16, 4
    state = stand_in.planner(hidden, (site,))  # 8 sequences: 17 slots, 8 steering keys at once
    rng = np.random.default_rng(2)
    vectors = {f"v{i}": rng.standard_normal(hidden).astype(np.float32) for i in range(16)}
    state.register_vectors({k: v.tobytes() for k, v in vectors.items()})

    def wave(keys):
        """One prefill step of a request per key; returns each request's prefill slot."""
        requests = {f"{k}-{id(keys)}": stand_in.request(RequestPayload(k, steer=(Steer(site, PREFILL | DECODE, k, 1.0),)), 1)
                    for k in keys}
        state.before_forward(stand_in.runner(requests, [(rid, 0, 1) for rid in requests]), len(keys))
        slots = state.steering.row_slot.numpy()[: len(keys)].copy()
        for row, key in enumerate(keys):
            np.testing.assert_array_equal(state.steering.table[0, slots[row]].numpy(), vectors[key], err_msg=key)
        state.after_forward()
        return dict(zip(keys, slots.tolist()))

    def finish():
        state.forget_finished({})

    first = wave([f"v{i}" for i in range(8)])
    finish()
    again = wave(["v3", "v5"])
    assert again == {"v3": first["v3"], "v5": first["v5"]}  # the rows were still in the table
    finish()
    later = wave([f"v{i}" for i in range(8, 16)])  # 8 new keys: the idle ones give their slots up
    assert len(set(later.values())) == 8
    finish()
    wave(["v3"])  # evicted: computed again, with the right values


def test_a_vector_registered_again_with_new_values_is_never_served_from_an_idle_slot():
    """A reused engine (a sweep's next job) may register a vector under a name it already holds: steering with it
    takes the new values, not the slot the old ones left in the table."""
    import numpy as np

    from interp_runner.contracts import DECODE, PREFILL, RequestPayload, Steer

    hidden, site = 16, 4
    state = stand_in.planner(hidden, (site,))
    old, new = (np.full(hidden, v, np.float32) for v in (1.0, -2.0))

    def steered_with(name: str, job: int) -> np.ndarray:
        requests = {f"r{job}": stand_in.request(RequestPayload(f"r{job}", steer=(Steer(site, PREFILL | DECODE, name, 1.0),)),
                                        1)}
        state.before_forward(stand_in.runner(requests, [(f"r{job}", 0, 1)]), 1)
        value = state.steering.table[0, state.steering.row_slot.numpy()[0]].numpy().copy()
        state.after_forward()
        state.forget_finished({})
        return value

    state.register_vectors({"v": old.tobytes()})
    np.testing.assert_array_equal(steered_with("v", 0), old)
    state.register_vectors({"v": old.tobytes()})  # the same values: the idle slot is still right
    np.testing.assert_array_equal(steered_with("v", 1), old)
    state.register_vectors({"v": new.tobytes()})
    np.testing.assert_array_equal(steered_with("v", 2), new)


def test_finished_requests_free_their_bank_rows_before_the_runner_drops_them():
    """The runner drops a finished request at its next step; a reused engine may register the next run's sources
    before taking one, so the rows a request kept are freed once the engine reports it finished."""
    from unittest import mock

    import numpy as np
    import vllm.distributed

    from interp_runner.contracts import Keep, KeepGroup, RequestPayload
    from interp_runner.payload import pack_positions, ref_key
    from interp_runner.plugin import runtime

    cfg = stand_in.engine_config(4)
    with mock.patch.object(vllm.distributed, "get_tensor_model_parallel_rank", lambda: 0):
        state = runtime.InterpState(cfg, {"plugin": "test", "steer_sites": [], "capture_sites": [4],
                                          "patch_sites": [4], "bank_rows": 4})
    keep = Keep("clean", (KeepGroup((4,), pack_positions(range(4))),))
    requests = {"clean-0001": stand_in.request(RequestPayload("clean", keep=keep), 4)}
    state.before_forward(stand_in.runner(requests, [("clean-0001", 0, 4)]), 4)
    state.after_forward()
    kept = [ref_key("clean", 4, p) for p in range(4)]
    assert sorted(state.patch_bank.rows) == sorted(kept)
    state.collect(["clean"])
    state.release_sources(kept)  # the run's end: released, but the runner still holds the request
    assert len(state.patch_bank.rows) == 4
    with np.testing.assert_raises_regex(RuntimeError, "bank is full"):
        state.register_sources({"next": np.ones(4, np.float32).tobytes()})
    state.finished(["clean"])  # what ``interp_collect`` does for the requests it collects
    assert state.patch_bank.rows == {}
    state.register_sources({"next": np.ones(4, np.float32).tobytes()})


def test_overlapping_capture_specs_copy_each_row_once_even_in_a_step_of_one_request():
    """Two capture specs of one request naming the same site and position (``last_prompt`` and ``all_prompt``,
    say) in a step that holds only that request's prompt: every position comes back with its own row's value."""
    import numpy as np
    import torch

    from interp_runner.contracts import Capture, RequestPayload
    from interp_runner.payload import pack_positions

    hidden, site, prompt_len = 16, 4, 10
    state = stand_in.planner(hidden, (site,))
    payload = RequestPayload("A", capture=(Capture((site,), pack_positions([prompt_len - 1]), False),
                                           Capture((site,), pack_positions(range(prompt_len)), False)))
    state.before_forward(stand_in.runner({"A": stand_in.request(payload, prompt_len)}, [("A", 0, prompt_len)]), prompt_len)
    x = torch.arange(prompt_len * hidden, dtype=torch.float32).reshape(prompt_len, hidden) + 1
    extra = torch.full_like(x, 0.5)
    state.apply_site(x, extra, site)
    state.after_forward()
    positions, values = state.collect(["A"])["A"]["captures"][site]
    assert positions.tolist() == list(range(prompt_len))
    np.testing.assert_array_equal(values, (x + extra).numpy())


def test_private_blocks_get_placeholder_hashes_and_stay_out_of_the_prefix_cache():
    from interp_runner.contracts import KvRange, RequestPayload, encode_payload
    from interp_runner.plugin import prefix_cache as pc

    def request(rid, kv, private=None):
        payload = RequestPayload(rid, kv=tuple(KvRange(*x) for x in kv), kv_private=private)
        return NS(request_id=rid, sampling_params=NS(extra_args={"interp": encode_payload(payload)}))

    vllm_keys = pc._with_interventions(lambda req, start, end, mm: (None, mm))
    cell = request("c-1", [(1, 2, "noise"), (40, 41, "restore")], 40)
    plain = request("p-1", [(1, 2, "noise")])
    # blocks of 16: before the private position, the interventions' digests as usual; from its block on, a
    # placeholder naming the request and block
    assert vllm_keys(cell, 0, 16, 0)[0] == ("interp", "noise") == vllm_keys(plain, 0, 16, 0)[0]
    assert vllm_keys(cell, 16, 32, 0)[0] is None
    assert vllm_keys(cell, 32, 48, 0)[0] == (pc.PRIVATE, "c-1", 32)
    assert vllm_keys(plain, 32, 48, 0)[0] is None
    contents = pc._private_placeholder(lambda fn, parent, tokens, keys: b"hash of contents")
    assert contents(None, None, [1] * 16, ("interp", "noise")) == b"hash of contents"
    placeholders = {contents(None, b"x", [1] * 16, vllm_keys(r, 48, 64, 0)[0])
                    for r in (cell, request("c-2", [(40, 41, "restore")], 40))}
    assert len(placeholders) == 2 and all(p.startswith(pc.PRIVATE.encode()) for p in placeholders)

    masks = []
    cache = pc._without_private_blocks(lambda self, req, blocks, cached, full, size, group, mask: masks.append(mask))
    pool = NS(hash_block_size=16)
    cache(pool, cell, [], 0, 4, 16, 0)  # blocks 0-1 shareable, 2-3 (from position 40 on) private
    cache(pool, cell, [], 3, 5, 16, 0)
    cache(pool, plain, [], 0, 4, 16, 0)
    cache(pool, cell, [], 0, 4, 16, 0, [True, False, True, True])
    assert masks == [[True, True, False, False], [False, False], None, [True, False, False, False]]


def test_private_blocks_are_hashed_in_bulk_as_vllm_hashes_them_one_by_one():
    """The request block hasher that makes a request's placeholders in one go gives the hashes vLLM's own hasher
    gives with the interventions' extra keys and placeholders, before and after generated tokens (appended at once,
    or one a step as in decoding)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import core
    from vllm.v1.request import Request

    from interp_runner.contracts import KvRange, RequestPayload, encode_payload
    from interp_runner.plugin import prefix_cache as pc

    pc.instrument_block_hashing()
    kv_cache_utils.init_none_hash(sha256_cbor)
    for private, n in [(None, 100), (0, 100), (17, 100), (32, 100), (99, 100), (50, 60), (64, 64), (192, 2000)]:
        payload = RequestPayload("x", kv=(KvRange(3, 4, "noise"), KvRange(40, 41, "restore")), kv_private=private)
        hashes = []
        for factory, one_a_step in [(kv_cache_utils.get_request_block_hasher, False),
                                    (core.get_request_block_hasher, False), (core.get_request_block_hasher, True)]:
            request = Request(request_id="r-1", prompt_token_ids=list(range(n)), pooling_params=None,
                              sampling_params=SamplingParams(max_tokens=20,
                                                             extra_args={"interp": encode_payload(payload)}),
                              block_hasher=factory(16, sha256_cbor))
            for tokens in [[t] for t in range(20)] if one_a_step else [list(range(20))]:
                request.append_output_token_ids(tokens)
            hashes.append(list(request.block_hashes))
        assert hashes[0] == hashes[1] == hashes[2] and len(hashes[0]) == (n + 20) // 16, (private, n)
    assert core.get_request_block_hasher is not kv_cache_utils.get_request_block_hasher


def test_patch_rows_follow_the_step_layout_and_a_later_entry_for_a_site_and_position_wins():
    from unittest import mock

    import numpy as np
    import torch
    import vllm.distributed

    from interp_runner.contracts import PatchColumns, RequestPayload
    from interp_runner.payload import pack_positions
    from interp_runner.plugin import runtime

    cfg = stand_in.engine_config(4)
    with mock.patch.object(vllm.distributed, "get_tensor_model_parallel_rank", lambda: 0):
        state = runtime.InterpState(cfg, {"plugin": "test", "steer_sites": [], "capture_sites": [],
                                          "patch_sites": [4, 9], "bank_rows": 8})
    state.register_sources({k: np.full(4, i, np.float32).tobytes() for i, k in enumerate(("s1", "s2", "s3"))})
    bank = state.patch_bank.rows

    def patch(entries):  # (site, position, source, value weight, source weight)
        sites, positions, keys, keep, take = zip(*entries)
        return PatchColumns(pack_positions(sites), pack_positions(positions), keys,
                            np.array(keep, np.float32).tobytes(), np.array(take, np.float32).tobytes())

    first = stand_in.request(RequestPayload("one", patch=patch([(9, 5, "s1", 0.0, 1.0), (4, 2, "s2", 0.5, 0.5),
                                                        (9, 5, "s3", 0.25, 0.75)])), 8)
    other = stand_in.request(RequestPayload("two", patch=patch([(4, 0, "s1", 0.0, 1.0)])), 3)
    requests = {"a": first, "b": other}

    def applied():
        rows = state.patches
        flat = torch.nonzero(rows.mask.view(-1)).flatten().tolist()
        return [(f // state.max_rows, f % state.max_rows, int(rows.idx.view(-1)[f]), rows.coef.view(-1, 2)[f].tolist())
                for f in flat]

    # step 1: "b" whole (rows 0-2), then "a" positions 0-3 (rows 3-6); step 2: "a" positions 4-7 (rows 0-3)
    state.before_forward(stand_in.runner(requests, [("b", 0, 3), ("a", 0, 4)]), 7)
    assert applied() == [(0, 0, bank["s1"], [0.0, 1.0]), (0, 5, bank["s2"], [0.5, 0.5])]
    state.before_forward(stand_in.runner(requests, [("a", 4, 4)]), 4)
    assert applied() == [(1, 1, bank["s3"], [0.25, 0.75])]  # site 9 (index 1), position 5: the later entry


def test_a_request_of_many_patch_entries_gets_the_entries_a_few_would(monkeypatch):
    """Packed cells' requests carry hundreds of entries, sorted in numpy: the same entries, winners and order as the
    plain path gives, and a site the engine lacks is refused the same way."""
    import msgspec
    import numpy as np
    import torch

    from interp_runner.contracts import PatchColumns
    from interp_runner.plugin import patches

    sites = (3, 7, 8, 20, 31)
    rows = patches.PatchRows(sites, torch.zeros(4, 2), "cpu", 512, None, None)
    rng = np.random.default_rng(0)
    for n in (33, 64, 400):
        s, p = rng.choice(sites, n).astype(np.int32), rng.integers(0, 40, n).astype(np.int32)  # with repeats
        a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        patch = PatchColumns(s.tobytes(), p.tobytes(), ("src",) * n, a.tobytes(), b.tobytes())
        banks = rng.integers(0, 100, n).tolist()
        monkeypatch.setattr(patches, "MANY_ENTRIES", 10**9)
        few = rows.entries(patch, banks)
        monkeypatch.setattr(patches, "MANY_ENTRIES", 32)
        assert rows.entries(patch, banks) == few and len(few.positions) < n
    patch = msgspec.structs.replace(patch, sites=np.array([*s[:-1], 5], dtype=np.int32).tobytes())  # 5: not a
    # patch site of this engine
    with pytest.raises(KeyError):
        rows.entries(patch, banks)


def test_kept_kv_copies_whole_blocks_out_and_in_and_frees_them_after_their_last_user():
    """A run's prompt KV is kept as whole KV-cache blocks (however a backend lays positions out inside one), is
    offered only once every position asked for is written, is copied into other blocks as it was, and is freed once
    released and no cell uses it."""
    import numpy as np
    import torch

    from interp_runner.payload import kv_key
    from interp_runner.plugin.kept_kv import KeptKV
    from interp_runner.plugin.records import RequestPlan
    from interp_runner.plugin.staging import PinnedRing

    block, num_blocks, layers = 4, 8, 2
    caches = [torch.randn(num_blocks, 2, block, 6) for _ in range(layers)]
    slots = torch.tensor([4 * block + i for i in range(block)] + [6 * block + i for i in range(block)])
    view = NS(kv_caches=lambda: caches, slot_mapping=lambda: slots)  # the run's 8 rows: blocks 4 and 6
    cpu = torch.device("cpu")
    kept = KeptKV(3, layers, caches[0][0].numel(), block, torch.float32, cpu, PinnedRing.for_device(cpu),
                  lambda *a: None)
    assert kept.reserve("run", 6) and not kept.reserve("run", 6)  # kept once
    assert kept.kept_from("run", 0)[0] == 0  # nothing computed yet
    plan = RequestPlan(rid="r", prompt_len=6, kv_keep="run")
    kept.plan_out(view, [plan], np.array([0, 6]), np.array([0]))  # prompt positions 0..5 in one step
    kept.after_forward()
    end, rows = kept.kept_from("run", 0)
    assert end == 6 and len(rows) == 2  # positions 0..5, blocks 4 and 6 (none beyond the prompt)
    end, later = kept.kept_from("run", 4)  # from the second block on
    assert end == 6 and later.tolist() == rows[1:].tolist()
    before = [c.clone() for c in caches]
    kept.copy_in(view, torch.tensor([0 * block + 1, 2 * block]), torch.from_numpy(rows))  # into blocks 0 and 2
    for c, old in zip(caches, before):
        torch.testing.assert_close(c[0], old[4], rtol=0, atol=0)
        torch.testing.assert_close(c[2], old[6], rtol=0, atol=0)
        torch.testing.assert_close(c[1], old[1], rtol=0, atol=0)
    assert not kept.reserve("other", 8)  # 2 blocks needed, 1 free
    kept.use("run")  # a packed request's cells reuse it
    kept.finish(("run",), writer=True)
    kept.release([kv_key("run")])
    assert kept.kept_from("run", 0)[0] == 6  # still in use
    kept.finish(("run",))
    assert kept.kept_from("run", 0)[0] == 0 and kept.reserve("other", 8)
    # written with a gap (positions 0..2 in one step, 6..7 in a later one): kept up to the gap only
    other = RequestPlan(rid="o", prompt_len=8, kv_keep="other")
    for first, count in ((0, 3), (6, 2)):
        kept.plan_out(view, [other], np.array([0, count]), np.array([first]))
        kept.after_forward()
    assert kept.kept_from("other", 0)[0] == 3 and kept.kept_from("other", 4)[0] == 4
    assert kept.kept_from("missing", 0)[0] == 0 and kept.kept_from("other", 8)[0] == 8
