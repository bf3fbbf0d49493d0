"""The room of vLLM's V1 model runner (``vllm/v1/worker/gpu_model_runner.py``; on a CPU ``cpu_model_runner.py``).

V1 keeps a persistent batch (``input_batch``: request ids in batch order, computed tokens, the block table) and its
requests (``requests``, with their sampling parameters). Its patches are ``runner_patches`` (``_prepare_inputs``:
packed cells planned after the inputs; ``_model_forward``: ``before_forward`` / ``after_forward`` around the model,
CUDA graphs switched off in the step's forward context; the CPU warm-up), its view ``runner_view.V1RunnerView``;
teacher forcing is a logits processor (``plugin.forcing``).
"""

from __future__ import annotations

from interp_runner.plugin import runner_patches
from interp_runner.plugin.runners.base import RunnerRoom


class V1Room(RunnerRoom):
    name = "v1"

    def instrument(self) -> None:
        runner_patches.instrument_model_runner()
        runner_patches.instrument_cpu_warm_up()


ROOM = V1Room()
