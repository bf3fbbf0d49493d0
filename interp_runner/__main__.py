"""``python -m interp_runner ...`` is ``interp-run ...``."""

from .cli import main

if __name__ == "__main__":
    main()
