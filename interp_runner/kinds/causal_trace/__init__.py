"""The causal-tracing kind (ROME-style): its plan, grids and figures. Imports compile/, store/ arrays and
kinds.base; never engine/.
"""

from interp_runner.kinds.causal_trace.kind import KIND

__all__ = ["KIND"]
