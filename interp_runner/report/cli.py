"""``interp-report PATH [--out FILE]``: (re)build the report of a store (``<name>.report.html`` beside it), or the
index page of a sweep folder (``index.html`` in it, beside ``sweep.json``). Exit 0 when written, 2 when PATH is
neither a store of this runner nor a sweep folder, or a store with an array that cannot be read. A report beside
the store replaces only the one the store lists as its own (``interp_runner.store.companions``), and is listed in it."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from interp_runner.store.companions import record, why_not_owned
from interp_runner.store.claim import StoreTarget, store_attrs
from interp_runner.store.read import UnreadableStore
from interp_runner.sweep import INDEX
from interp_runner.report.run_report import write_report
from interp_runner.report.sweep_index import INDEX_PAGE, write_index_page

USAGE_ERROR = 2


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="interp-report", description="(Re)build the HTML report of a store, "
                                     "or the index page of a sweep folder.")
    parser.add_argument("path", type=Path, help="a store (e.g. results.zarr) or a sweep folder (holding sweep.json)")
    parser.add_argument("--out", type=Path, help="the HTML file to write (default: <name>.report.html beside the "
                                                 f"store, or {INDEX_PAGE} in the sweep folder)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    path = args.path
    attrs = store_attrs(path)
    if attrs is not None:
        beside = args.out is None
        out = StoreTarget.at(path).report if beside else args.out
        why = why_not_owned("report", out, path, attrs) if beside and os.path.lexists(out) else None
        if why is not None:
            print(f"interp-report: {out} is not the store's own report ({why}): it is never replaced; move it "
                  "away, or write the report elsewhere with --out", file=sys.stderr)
            return USAGE_ERROR
        try:
            written = write_report(path, out)
        except UnreadableStore as err:
            print(f"interp-report: error: {err}", file=sys.stderr)
            return USAGE_ERROR
        if beside:
            record(path, {"report": written})
    elif (path / INDEX).is_file():
        written = write_index_page(path, out_path=args.out)
    else:
        print(f"interp-report: {path} is neither a store of interp-runner nor a sweep folder (no {INDEX})",
              file=sys.stderr)
        return USAGE_ERROR
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
