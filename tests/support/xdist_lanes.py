"""``make test`` on pytest-xdist workers: which test files share a worker, and which start first.

Files that share a session resource too costly to build twice (a process of their own) run in one worker: the
scheduler gives them one scope. Files start in order of their tests that start engines or processes, most first, so
that the longest files do not start last and leave one worker alone at the end."""

from __future__ import annotations

from collections import Counter

from xdist.scheduler import LoadFileScheduling

# file -> the file whose worker it joins, for the resource they share
SHARED_WITH = {
    "tests/test_run_log.py": "tests/test_cli.py",  # the smoke experiment's `interp-run` process (smoke_process)
    "tests/test_tensor_parallel.py": "tests/test_seeded_weights.py",  # the TP = 1 and TP = 2 processes (TP_RUNS)
}
COSTLY = ("engine", "cli", "slow")


class SharedFileScheduling(LoadFileScheduling):
    """Whole files to workers, as ``--dist loadfile``, with the files of ``SHARED_WITH`` as one, in collection
    order (``order_by_cost`` sets it)."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        config.option.loadscopereorder = False  # xdist's reordering counts tests, not their cost

    def _split_scope(self, nodeid: str) -> str:
        path = super()._split_scope(nodeid)
        return SHARED_WITH.get(path, path)


def order_by_cost(items: list) -> None:
    """Sort ``items`` by file (with the files it shares a worker with), costliest first; stable within a file."""
    def scope(item) -> str:
        path = item.nodeid.split("::", 1)[0]
        return SHARED_WITH.get(path, path)

    cost = Counter()
    for item in items:
        cost[scope(item)] += 1 if "gpu" in item.keywords else (10 if any(m in item.keywords for m in COSTLY) else 1)
    first_seen = {s: i for i, s in reversed(list(enumerate(scope(item) for item in items)))}
    items.sort(key=lambda item: (-cost[scope(item)], first_seen[scope(item)]))
