"""What the plugin needs of a vLLM model runner, and where a runner's room plugs in.

Each model runner vLLM may pick has a room (a module here) that patches that runner's class once per process
(``RunnerRoom.instrument``) so that every real step of the runner:

- admits the requests it adds and forgets the ones it removes (the view's ``new_request`` / ``live_requests``);
- gives the step's batch in batch order (``StepBatch``: request ids, query starts, computed tokens) once its inputs
  are prepared, then calls ``InterpState.plan_sequences`` (packed cells: attention sequences, positions) and hands the
  attention metadata builders the packed sequences (``runner_patches._packed_sequences``);
- calls ``InterpState.before_forward`` before the model runs (buffers filled; CUDA graphs only where the step needs
  nothing outside them), runs a step of cells that skip layers layer by layer (``skipping.run_layers``), and calls
  ``after_forward`` after it;
- scores through the model's ``compute_logits`` (``runner_patches._score_logits``) and, where the runner has no
  custom logits processors, forces tokens in its sampler.

Everything else (``runtime.InterpState`` and its components) reads the runner only through the room's
``runner_view.RunnerView``. A vLLM whose runner changed gets a new room, registered in ``runners/__init__.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

ROOM_ATTR = "_interp_room"  # set on a patched runner class: the name of its room
VIEW_ATTR = "_interp_view_class"  # set on a patched runner class: its RunnerView class


class RunnerRoom(ABC):
    name: str  # what provenance records: "v1", "v2"

    @abstractmethod
    def instrument(self) -> None:
        """Patch the runner's classes (this process; idempotent)."""


def room_name(runner) -> str | None:
    """The room whose patches drive this runner (None: a runner no room patched, which never plans a step)."""
    for cls in type(runner).__mro__:
        if ROOM_ATTR in cls.__dict__:
            return cls.__dict__[ROOM_ATTR]
    return None


def mark(cls, room: str, view_class) -> None:
    setattr(cls, ROOM_ATTR, room)
    setattr(cls, VIEW_ATTR, view_class)
