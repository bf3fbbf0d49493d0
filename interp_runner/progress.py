"""Progress of a stage's requests: a tqdm bar on a terminal, one plain line per unit of work elsewhere (CI, batch
logs), never carriage-return updates in a file."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from tqdm import tqdm


def on_terminal(stream=None) -> bool:
    stream = stream or sys.stderr
    return hasattr(stream, "isatty") and stream.isatty()


class StageProgress:
    """Requests (or trace cells) done of a stage's total, with rate and ETA."""

    def __init__(self, desc: str, total: int, log: Callable[[str], None], bar: bool | None = None):
        self.desc, self.total, self.log = desc, total, log
        self.bar = tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, leave=True,
                        file=sys.stderr) if (on_terminal() if bar is None else bar) else None
        self.done = 0
        self.t0 = time.perf_counter()

    def advance(self, n: int) -> None:
        """``n`` more requests finished (called as the engine reports them)."""
        self.done += n
        if self.bar is not None:
            self.bar.update(n)

    def unit_finished(self, unit: int, units: int) -> None:
        if self.bar is not None or units <= 0:
            return
        elapsed = time.perf_counter() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        self.log(f"{self.desc}: unit {unit + 1}/{units}, {self.done}/{self.total} requests, "
                 f"{rate:.1f}/s, elapsed {tqdm.format_interval(elapsed)}, ETA {tqdm.format_interval(eta)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def iterate(items, desc: str, log: Callable[[str], None]):
    """``items`` with a bar on a terminal; elsewhere one line when done."""
    items = list(items)
    t0 = time.perf_counter()
    yield from (tqdm(items, desc=desc, file=sys.stderr, dynamic_ncols=True) if on_terminal() else items)
    if not on_terminal():
        log(f"{desc}: {len(items)} in {time.perf_counter() - t0:.1f} s")
