"""interp-runner: declarative interpretability experiments on an embedded vLLM (see README.md).

Kept free of imports: vLLM imports ``interp_runner.plugin`` in every process of every engine.
"""


def open_sweep(path):
    """A multirun sweep folder as one xarray Dataset (see ``interp_runner.sweep.open_sweep``)."""
    from interp_runner.sweep import open_sweep as _open_sweep

    return _open_sweep(path)
