"""vLLM plugin: interp custom ops, instrumented decoder layers and the per-step planner.

vLLM calls ``register()`` in every one of its processes. It does nothing unless the process was started by
interp-runner with interp ops enabled (``INTERP_RUNNER_PLUGIN=1``), so other engines in the same environment
are left untouched. Even then, only engines whose ``additional_config`` carries an interp spec are instrumented.

Imports models/ (block layouts) and the shared records (contracts, payload, sites) only: never the host's packages.
"""

import atexit
import gc
import os

ENABLE_ENV = "INTERP_RUNNER_PLUGIN"
_registered = False


def register() -> None:
    global _registered
    if _registered or os.environ.get(ENABLE_ENV) != "1":
        return
    from interp_runner.plugin import (collect_order, kv_groups, layers, ops, parent_watch, prefix_cache, runners,
                                      seeded_loader, served_results)

    parent_watch.start()
    # vLLM unfreezes the heap when it shuts an engine down, and at exit the interpreter's last collections walk all
    # of it (~2 s a process, past the 5 s vLLM gives an engine core before killing it): frozen, it ends with the
    # process (whatever holds a file or a store closes it before, not at those collections)
    atexit.register(gc.freeze)
    ops.register_ops()
    seeded_loader.register()
    layers.instrument_decoder_layers()
    runners.instrument()  # every model runner vLLM may pick (``runners``)
    prefix_cache.instrument_block_hashing()
    collect_order.instrument_engine_core()
    served_results.instrument_engine_core()
    kv_groups.keep_fields_when_unifying()
    _registered = True


def is_registered() -> bool:
    return _registered
