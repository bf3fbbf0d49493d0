"""Interp kernels: the row-wise primitives the vLLM plugin's ops are made of.

Each primitive has a plain-torch implementation here (used on CPU, and the reference for faster kernels).
"""

from .reference import gather_add, gather_rows, patch_pair, patch_rows

__all__ = ["gather_add", "gather_rows", "patch_pair", "patch_rows"]
