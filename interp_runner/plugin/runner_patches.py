"""The patches of vLLM's V1 GPU model runner: every place the plugin hooks into a step.

- ``_prepare_inputs``: a step with packed cells is planned (``InterpState.plan_sequences``) and the attention
  metadata builders see its sequences instead of its requests (``_packed_sequences``);
- ``_model_forward``: the state plans the step (``InterpState.before_forward``) and finishes it (``after_forward``);
  a step that captures outside the buffers or runs packed cells runs outside CUDA graphs, one that skips layers
  layer by layer (``skipping.run_layers``);
- the model's ``compute_logits`` (outside the compiled graph): the step's scores;
- the CPU runner's warm-up (``CPUModelRunner`` is a ``GPUModelRunner``): a few tokens for an eager interp engine;
- the sampler's rank of a sampled token: counted without torch.compile once an eager interp engine binds.

The runner is read through ``runner_view.V1RunnerView``. (Prefix-cache hashing is patched in vLLM's engine core,
another process: ``prefix_cache``; decoder layers in ``layers``.) This is the V1 runner's room
(``runners.v1``); ``state_of``, ``_score_logits`` and ``_packed_sequences`` serve every room (``runners.base``).
"""

from __future__ import annotations

from interp_runner.plugin import skipping
from interp_runner.plugin.ops import activate
from interp_runner.plugin.runner_view import V1RunnerView
from interp_runner.plugin.runners.base import VIEW_ATTR, mark, room_name


def state_of(runner):
    """The interp state of a model runner's engine (None: built without interp ops), bound to the runner on first
    use."""
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
            runner._interp_view = (getattr(type(runner), VIEW_ATTR, None) or V1RunnerView)(runner)
            from vllm.config import CompilationMode

            if runner.compilation_config.mode == CompilationMode.NONE:
                _uncompiled_sampler_ranks()
        runner._interp_state = state
    return state


def _uncompiled_sampler_ranks() -> None:
    """vLLM ranks each sampled token among the vocabulary (for its logprob) with a function it compiles on first
    use: seconds at every engine start, tens on a cold Inductor cache, for an engine that compiles nothing else.
    An eager interp engine counts eagerly (the same integers); only interp engines of this process bind here."""
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = _count_at_least


def _count_at_least(x, values):
    return (x >= values).sum(-1)


def view_of(runner) -> V1RunnerView:
    """The view of a runner whose state is bound (``state_of``)."""
    return runner._interp_view


def plans_steps(runner) -> bool:
    """Whether a room patched the runner's class (any other runner would never plan a step)."""
    return room_name(runner) is not None


def _score_logits(model, state) -> None:
    """Wrap the model's compute_logits (outside the compiled graph) so scoring steps read their logits; packed
    cells' logits are computed here too, from their rows of the step's hidden states. A step of packed requests
    only gives vLLM zeros for its requests' logits: the tokens it samples from them are never read (a cell's token
    is its score's top), so the LM head runs over the cells' rows alone."""
    original = model.compute_logits
    readback = state.readback

    def compute_logits(hidden_states, *args, **kwargs):
        cells = None
        packed_step = readback.cell_hidden is not None
        if packed_step:
            cells, readback.cell_hidden = original(readback.cell_hidden), None
        if packed_step and readback.only_packed and not readback.score_rows:
            # the same on every rank: where vLLM gathers logits to one rank, the others get None from both calls
            logits = None if cells is None else cells.new_zeros(hidden_states.shape[0], cells.shape[1])
        else:
            logits = original(hidden_states, *args, **kwargs)
        if readback.score_rows and logits is not None:
            readback.record_scores(logits)
        if cells is not None:
            readback.record_cell_scores(cells)
        return logits

    model.compute_logits = compute_logits


def _packed_sequences(builder, state) -> None:
    """Make an attention metadata builder see a packed step's sequences instead of its requests."""
    if "build" in builder.__dict__:
        return
    original = builder.build
    packing = state.packing

    def build(common_prefix_len, common_attn_metadata, *args, **kwargs):
        seqs = packing.sequences
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
        variants = packing.layer_metadata[id(builder)] = skipping.metadata_by_sequences(
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
        state = state_of(self)
        if state is not None:
            view = self._interp_view
            state.plan_sequences(view)
            if state.packing.sequences is not None:
                for builder in view.metadata_builders():
                    _packed_sequences(builder, state)
        return out

    def _model_forward(self, *args, **kwargs):
        state = state_of(self)
        if state is None:
            return original(self, *args, **kwargs)
        activate(state)
        packing, readback = state.packing, state.readback
        positions = kwargs.get("positions")
        if state.before_forward(self._interp_view, positions.shape[-1]) or packing.sequences is not None:
            context = get_forward_context()
            context.cudagraph_runtime_mode = CUDAGraphMode.NONE
        try:
            if packing.sequences is not None and packing.sequences["skip"] is not None:
                output = skipping.run_layers(self._interp_view, state, kwargs["input_ids"], positions)
            else:
                output = original(self, *args, **kwargs)
            if readback.cells is not None:
                readback.cell_hidden = output.index_select(0, readback.cells.rows)
            return output
        finally:
            packing.end_step()
            state.after_forward()

    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner._model_forward = _model_forward
    mark(GPUModelRunner, "v1", V1RunnerView)


WARM_UP_TOKENS = 64


def instrument_cpu_warm_up() -> None:
    """On a CPU, vLLM warms an engine up by running the model over a whole step's tokens (4,096 by default) for the
    compile, then its sampler (whose random sampling and token ranks it compiles: seconds warm, tens of seconds on
    a cold Inductor cache). An eager engine compiles nothing and is given its KV cache size, so an interp engine that
    runs eagerly warms up on ``WARM_UP_TOKENS`` tokens and leaves the sampler's compile to a plan that samples."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.config import CompilationMode
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if "_interp_original_warm_up" in CPUModelRunner.__dict__:
        return
    original = CPUModelRunner.warming_up_model
    CPUModelRunner._interp_original_warm_up = original

    def warming_up_model(self):
        if state_of(self) is None or self.compilation_config.mode != CompilationMode.NONE:
            return original(self)
        self._dummy_run(min(self.max_num_tokens, WARM_UP_TOKENS), is_profile=True)

    CPUModelRunner.warming_up_model = warming_up_model
