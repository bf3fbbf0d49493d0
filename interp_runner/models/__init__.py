"""Model materialization helpers (see materialize.py)."""
