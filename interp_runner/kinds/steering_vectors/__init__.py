"""The steering-vectors kind: contrastive pairs to vectors, their checks and evaluation. Imports
compile/, vectors/ and kinds.base; never engine/.
"""

from interp_runner.kinds.steering_vectors.kind import KIND

__all__ = ["KIND"]
