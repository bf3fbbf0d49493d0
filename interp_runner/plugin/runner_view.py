"""What the planner reads from vLLM's model runner, behind one small interface.

The state's planner (``runtime.InterpState``) and the packed-sequence planner read a step's batch, new requests'
payloads and, for packed steps, the block table and positions through a ``RunnerView``; ``V1RunnerView`` reads them
from vLLM's V1 ``GPUModelRunner``. Another runner (another batch or block layout) plugs in with a view of its own
and its own patches (``runner_patches``).
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from typing import NamedTuple, Protocol

import numpy as np
import torch

from interp_runner.contracts import RequestPayload, payload_of


class StepBatch:
    """A step's batch: request ``i`` (``req_ids[i]``, batch order) owns the step's rows ``query_start[i] ..
    query_start[i + 1] - 1``, the first of them at position ``computed[i]``. A view fills one in place each step
    (it holds the step's values until the view's next ``batch()``)."""

    __slots__ = ("num_reqs", "req_ids", "query_start", "computed")

    def __init__(self) -> None:
        self.num_reqs = 0
        self.req_ids: list[str] = []
        self.query_start: np.ndarray | None = None  # the runner's host buffers, read up to num_reqs (+ 1): later
        self.computed: np.ndarray | None = None  # entries are stale


class NewRequest(NamedTuple):
    payload: RequestPayload | None  # its interp payload (None: a request without one)
    prompt_len: int


class RunnerView(Protocol):
    def batch(self) -> StepBatch: ...

    def live_requests(self) -> Container[str]:
        """The ids of the requests the runner holds (others have finished)."""

    def new_request(self, rid: str) -> NewRequest: ...

    # packed steps
    block_size: int

    def prompt_lens(self, n: int) -> np.ndarray: ...

    def block_table(self, n: int) -> torch.Tensor:
        """The device block table of the batch's first ``n`` requests (one KV-cache group)."""

    def write_positions(self, num_tokens: int, positions: torch.Tensor) -> None:
        """Replace the positions of the step's first ``num_tokens`` rows."""

    # steps run layer by layer
    def model(self) -> torch.nn.Module: ...

    def attention_layers(self) -> list[list[tuple[str, int]]]:
        """Per decoder layer, its attention layers: (name, id of their metadata builder)."""

    def metadata_builders(self) -> Iterator[object]: ...

    # kept KV (``kept_kv``)
    def kv_caches(self) -> list[torch.Tensor]:
        """The KV cache of each decoder layer, in layer order."""

    def slot_mapping(self) -> torch.Tensor:
        """The KV-cache slot of each of the running step's rows, in batch order (one KV-cache group)."""


class V1RunnerView:
    """vLLM's V1 ``GPUModelRunner``: its persistent input batch and buffers."""

    __slots__ = ("runner", "_batch", "_attention_layers")

    def __init__(self, runner):
        self.runner = runner
        self._batch = StepBatch()
        self._attention_layers: list | None = None

    def batch(self) -> StepBatch:
        runner, out = self.runner, self._batch
        batch = runner.input_batch
        out.num_reqs = n = batch.num_reqs
        out.req_ids = batch.req_ids[:n]
        out.query_start = runner.query_start_loc.np
        out.computed = batch.num_computed_tokens_cpu
        return out

    def live_requests(self) -> Container[str]:
        return self.runner.requests

    def new_request(self, rid: str) -> NewRequest:
        request = self.runner.requests[rid]
        return NewRequest(payload_of(request.sampling_params), request.num_prompt_tokens)

    @property
    def block_size(self) -> int:
        return self.runner.cache_config.block_size

    def prompt_lens(self, n: int) -> np.ndarray:
        return self.runner.input_batch.num_prompt_tokens[:n]

    def block_table(self, n: int) -> torch.Tensor:
        return self.runner.input_batch.block_table[0].get_device_tensor(n)

    def write_positions(self, num_tokens: int, positions: torch.Tensor) -> None:
        self.runner.positions[:num_tokens].copy_(positions)

    def model(self) -> torch.nn.Module:
        return self.runner.get_model()

    def attention_layers(self) -> list[list[tuple[str, int]]]:
        if self._attention_layers is None:
            from vllm.model_executor.models.utils import extract_layer_index

            by_layer: dict[int, list] = {}
            for group in self.runner.attn_groups[0]:
                builder = group.metadata_builders[0]
                for name in group.layer_names:
                    by_layer.setdefault(extract_layer_index(name), []).append((name, id(builder)))
            self._attention_layers = [by_layer.get(i, []) for i in range(max(by_layer) + 1)]
        return self._attention_layers

    def metadata_builders(self) -> Iterator[object]:
        """The attention metadata builders (packed steps need one KV-cache group)."""
        if len(self.runner.attn_groups) != 1:
            raise RuntimeError("interp: packed cells need a model with one KV-cache group")
        for group in self.runner.attn_groups[0]:
            yield from group.metadata_builders

    def kv_caches(self) -> list[torch.Tensor]:
        return self.runner.kv_caches

    def slot_mapping(self) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        mapping = get_forward_context().slot_mapping
        if not isinstance(mapping, dict) or not mapping:
            raise RuntimeError("interp: kept KV needs the step's slot mapping per layer")
        return next(iter(mapping.values()))
