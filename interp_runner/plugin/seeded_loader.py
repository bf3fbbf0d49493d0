"""vLLM load format ``interp_seeded``: a model's weights drawn from a seed (``interp_runner.models.seeded``).

Every tensor of the full checkpoint is built on the rank's device, one at a time, and handed to the model's own
``load_weights``, whose weight loaders keep the rank's shard: every tensor-parallel size holds the same weights.
The seed comes in ``model_loader_extra_config={"seed": N}``.
"""

from __future__ import annotations

from interp_runner.models.seeded import LOAD_FORMAT, checkpoint

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    import torch.nn as nn
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    @register_model_loader(LOAD_FORMAT)
    class SeededModelLoader(BaseModelLoader):
        def __init__(self, load_config):
            super().__init__(load_config)
            extra = dict(load_config.model_loader_extra_config or {})
            seed = extra.get("seed")
            if set(extra) != {"seed"} or isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
                raise ValueError(f"load format {LOAD_FORMAT} takes model_loader_extra_config={{'seed': int >= 0}}, "
                                 f"not {extra}")
            self.seed = seed

        def download_model(self, model_config) -> None:
            pass  # nothing to download

        def load_weights(self, model: nn.Module, model_config) -> None:
            device = next(model.parameters()).device
            expected = {name for name, _ in model.named_parameters()}
            loaded = model.load_weights(checkpoint(model_config.model, self.seed, device))
            missing = expected - set(loaded or ())
            if missing:
                raise ValueError(f"seeded checkpoint of {model_config.model} left {sorted(missing)} unset")

    _registered = True
