"""The room of vLLM's V2 model runner (``vllm/v1/worker/gpu/model_runner.py``; on a CPU its subclass in
``vllm/v1/worker/cpu/model_runner.py``).

V2 keeps each request's state in fixed slots (``req_states``, the sampler's states) and builds each step's batch
afresh (``prepare_inputs`` → ``InputBatch``: request ids in batch order, ``idx_mapping`` from batch rows to slots,
query starts, computed tokens, the positions buffer). The plugin attaches at its seams:

- ``add_requests`` / ``_remove_request``: each added request's payload and prompt length, read once
  (``V2RunnerView.new_request``; V2 keeps no sampling parameters per request);
- ``prepare_attn`` (after ``prepare_inputs``, before the attention metadata is built): the step's batch, block
  tables and slot mappings are bound to the view; packed cells are planned (``InterpState.plan_sequences``: positions
  rewritten in the buffer, the metadata builders given the sequences) and the buffers filled
  (``InterpState.before_forward``); a step of cells that skip layers gets ``skipping.run_layers`` as its model;
- ``dispatch_cg_and_sync_dp``: V2 picks a step's CUDA-graph mode before its inputs are prepared; a step with packed
  cells runs eagerly (known from the scheduled requests' payloads), and a step whose captures overflow the buffers
  (known once planned) has its descriptor (a copy of vLLM's, the step's own) switched to eager in ``prepare_attn``;
- ``execute_model``: after the forward, packed cells' hidden rows are kept for their logits and the step finished
  (``after_forward``); a dummy step clears the buffers first;
- the sampler (``runners.v2_sampler``): teacher forcing (V2 refuses custom logits processors).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import torch

from interp_runner.contracts import payload_of

from interp_runner.plugin import skipping
from interp_runner.plugin.ops import activate
from interp_runner.plugin.runner_patches import WARM_UP_TOKENS, _packed_sequences, state_of
from interp_runner.plugin.runner_view import NewRequest, V1RunnerView
from interp_runner.plugin.runners.base import ROOM_ATTR, RunnerRoom, mark


class V2RunnerView(V1RunnerView):
    """vLLM's V2 ``GPUModelRunner``: the step's ``InputBatch`` and attention inputs (bound by the patches), its
    request slots. Attention groups, KV caches and the block size are read as V1's (the same vLLM objects)."""

    __slots__ = ("added", "input_batch", "block_tables", "slot_mappings", "_empty")

    def __init__(self, runner):
        super().__init__(runner)
        self.added: dict[str, NewRequest] = {}
        self.input_batch = None
        self.block_tables = None
        self.slot_mappings = None
        self._empty = np.zeros(1, dtype=np.int32)

    def begin_step(self, input_batch, block_tables, slot_mappings) -> None:
        self.input_batch, self.block_tables, self.slot_mappings = input_batch, block_tables, slot_mappings

    def end_step(self) -> None:
        self.input_batch = self.block_tables = self.slot_mappings = None

    def batch(self):
        out, batch = self._batch, self.input_batch
        if batch is None:  # a dummy step: no request
            out.num_reqs, out.req_ids, out.query_start, out.computed = 0, [], self._empty, self._empty
            return out
        out.num_reqs = n = batch.num_reqs
        out.req_ids = batch.req_ids[:n]
        out.query_start = batch.query_start_loc_np
        out.computed = batch.num_computed_tokens_np  # in batch order already
        return out

    def live_requests(self):
        return self.runner.req_states.req_id_to_index

    def new_request(self, rid: str) -> NewRequest:
        return self.added[rid]

    def prompt_lens(self, n: int) -> np.ndarray:
        return self.runner.req_states.prompt_len.np[self.input_batch.idx_mapping_np[:n]]

    def block_table(self, n: int) -> torch.Tensor:
        return self.block_tables[0][:n]

    def write_positions(self, num_tokens: int, positions: torch.Tensor) -> None:
        self.input_batch.positions[:num_tokens].copy_(positions)

    def model(self) -> torch.nn.Module:
        model = self.runner.model
        return getattr(model, "_interp_model", model)

    def slot_mapping(self) -> torch.Tensor:
        return self.slot_mappings[0]


class _LayerByLayer:
    """Stands for the model in a step of cells that skip layers: calling it runs ``skipping.run_layers``."""

    def __init__(self, model, view, state):
        self._interp_model, self._view, self._state = model, view, state

    def __call__(self, input_ids=None, positions=None, **_):
        return skipping.run_layers(self._view, self._state, input_ids, positions)

    def __getattr__(self, name):
        return getattr(self._interp_model, name)


class _Step(threading.local):
    runner = None  # the runner whose execute_model runs
    desc = None  # its step's BatchExecutionDescriptor (the step's own copy)


_step = _Step()


def _runs_packed_cells(runner) -> bool:
    """Whether a scheduled request runs packed cells: attention over sequences no CUDA graph was captured for."""
    view = runner.__dict__.get("_interp_view")
    sched = runner.__dict__.get("_interp_scheduled")
    if view is None or sched is None:
        return False
    for rid in sched.num_scheduled_tokens:
        new = view.added.get(rid)
        if new is not None and new.payload is not None and new.payload.cells is not None:
            return True
    return False


def _run_eagerly(desc) -> None:
    """Switch the step's own descriptor to eager (its padded shape stays: eager runs any shape)."""
    from vllm.config import CUDAGraphMode

    object.__setattr__(desc, "cg_mode", CUDAGraphMode.NONE)


class V2Room(RunnerRoom):
    name = "v2"

    def instrument(self) -> None:
        from vllm.config import CUDAGraphMode
        from vllm.platforms import current_platform
        from vllm.v1.worker.gpu import model_runner as module

        from interp_runner.plugin.runners import v2_sampler

        cls = module.GPUModelRunner
        if ROOM_ATTR in cls.__dict__:
            return
        if current_platform.is_cpu():
            _allow_without_triton()
            _eager_cpu_warm_up()
        v2_sampler.instrument()
        add, remove = cls.add_requests, cls._remove_request
        prepare_attn, execute = cls.prepare_attn, cls.execute_model
        dispatch = module.dispatch_cg_and_sync_dp

        def add_requests(self, scheduler_output):
            add(self, scheduler_output)
            if state_of(self) is None:
                return
            added = self._interp_view.added
            for new in scheduler_output.scheduled_new_reqs:
                added[new.req_id] = NewRequest(payload_of(new.sampling_params), len(new.prompt_token_ids))

        def _remove_request(self, req_id):
            view = self.__dict__.get("_interp_view")
            if view is not None:
                view.added.pop(req_id, None)
            return remove(self, req_id)

        def dispatch_cg_and_sync_dp(*args, **kwargs):
            runner = _step.runner
            if runner is not None and _runs_packed_cells(runner):
                kwargs["need_eager"] = True
            desc, across = dispatch(*args, **kwargs)
            desc = _step.desc = dataclasses.replace(desc)
            return desc, across

        def prepare_attn_planned(self, input_batch):
            out = prepare_attn(self, input_batch)
            state = state_of(self)
            if state is None:
                return out
            view = self._interp_view
            view.begin_step(input_batch, *out)
            state.plan_sequences(view)
            packing = state.packing
            if packing.sequences is not None:
                for builder in view.metadata_builders():
                    _packed_sequences(builder, state)
            outside = state.before_forward(view, input_batch.num_tokens_after_padding)
            desc = _step.desc
            if (outside or packing.sequences is not None) and desc is not None \
                    and desc.cg_mode != CUDAGraphMode.NONE:
                _run_eagerly(desc)
            if packing.sequences is not None and packing.sequences["skip"] is not None:
                self.model = _LayerByLayer(self.model, view, state)
            return out

        def execute_model(self, scheduler_output, *args, **kwargs):
            state = state_of(self)
            if state is None:
                return execute(self, scheduler_output, *args, **kwargs)
            activate(state)
            view = self._interp_view
            dummy = kwargs.get("dummy_run", args[1] if len(args) > 1 else False)
            if dummy:  # no request: nothing applied, nothing captured
                view.end_step()
                state.before_forward(view, scheduler_output.total_num_scheduled_tokens)
            _step.runner, _step.desc = self, None
            self._interp_scheduled = scheduler_output
            try:
                output = execute(self, scheduler_output, *args, **kwargs)
                readback, done = state.readback, self.execute_model_state
                if view.input_batch is not None and readback.cells is not None and done is not None:
                    readback.cell_hidden = done.hidden_states.index_select(0, readback.cells.rows)
                return output
            finally:
                if isinstance(self.model, _LayerByLayer):
                    self.model = self.model._interp_model
                if view.input_batch is not None or dummy:
                    state.packing.end_step()
                    state.after_forward()
                view.end_step()
                _step.runner = _step.desc = self._interp_scheduled = None

        cls.add_requests = add_requests
        cls._remove_request = _remove_request
        cls.prepare_attn = prepare_attn_planned
        cls.execute_model = execute_model
        module.dispatch_cg_and_sync_dp = dispatch_cg_and_sync_dp
        mark(cls, self.name, V2RunnerView)


def _eager_cpu_warm_up() -> None:
    """V2's CPU warm-up runs the model over a whole step's tokens and its sampler, for a compile: an eager interp
    engine warms up on ``runner_patches.WARM_UP_TOKENS`` tokens, as under V1."""
    from vllm.config import CompilationMode
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner

    original = CPUModelRunner.warming_up_model

    def warming_up_model(self):
        if state_of(self) is None or self.compilation_config.mode != CompilationMode.NONE:
            return original(self)
        self._dummy_run(min(self.max_num_tokens, WARM_UP_TOKENS), skip_attn=True, is_profile=True)

    CPUModelRunner.warming_up_model = warming_up_model


def _allow_without_triton() -> None:
    """vLLM refuses its V2 runner where Triton has no backend; on a CPU the runner's kernels have torch ports
    (``v2_cpu``), installed here with the check lifted for engines that ask for V2 (``VLLM_USE_V2_MODEL_RUNNER``;
    vLLM's own choice, ``auto``, still sees no Triton and keeps V1)."""
    from vllm.config import vllm as config_module
    from vllm.triton_utils import HAS_TRITON

    from interp_runner.plugin.runners import v2_cpu

    if HAS_TRITON:
        return
    v2_cpu.install()
    validate = config_module.VllmConfig._validate_v2_model_runner
    if getattr(validate, "_interp_wrapped", False):
        return

    def _validate_v2_model_runner(self):
        config_module.HAS_TRITON = True
        try:
            return validate(self)
        finally:
            config_module.HAS_TRITON = False

    _validate_v2_model_runner._interp_wrapped = True
    config_module.VllmConfig._validate_v2_model_runner = _validate_v2_model_runner


ROOM = V2Room()
