"""vLLM plugin: interp custom ops, instrumented decoder layers and the per-step planner.

vLLM calls ``register()`` in every one of its processes. It does nothing unless the process was started by
interp-runner with interp ops enabled (``INTERP_RUNNER_PLUGIN=1``), so other engines in the same environment
are left untouched. Even then, only engines whose ``additional_config`` carries an interp spec are instrumented.
"""

import os

ENABLE_ENV = "INTERP_RUNNER_PLUGIN"
_registered = False


def register() -> None:
    global _registered
    if _registered or os.environ.get(ENABLE_ENV) != "1":
        return
    from . import layers, ops, prefix_cache, runner_patches, seeded_loader

    ops.register_ops()
    seeded_loader.register()
    layers.instrument_decoder_layers()
    runner_patches.instrument_model_runner()
    runner_patches.instrument_cpu_warm_up()
    prefix_cache.instrument_block_hashing()
    _registered = True


def is_registered() -> bool:
    return _registered
