"""The model runners the plugin drives, one room each (``base.RunnerRoom``): V1 (``v1``) and V2 (``v2``).

``instrument`` patches every room's runner classes, so whichever runner vLLM picks for an engine plans its steps;
``base.room_name`` tells which one a worker's runner is (the engine records it as the run's ``model_runner``). The
rooms are imported when instrumenting (they import the plugin's shared patches, which import ``base``).
"""

from __future__ import annotations

def instrument() -> None:
    from interp_runner.plugin.runners import v1, v2

    for room in (v1.ROOM, v2.ROOM):
        room.instrument()
