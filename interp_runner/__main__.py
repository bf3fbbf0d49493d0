"""``python -m interp_runner ...`` is ``interp-run ...``."""

from interp_runner.cli import main_as_module

if __name__ == "__main__":
    main_as_module()
