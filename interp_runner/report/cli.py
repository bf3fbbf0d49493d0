"""``interp-report PATH [--out FILE]``: (re)build the report of a store (``<stem>.report.html`` beside it), or the
index page of a sweep folder (``index.html`` in it, beside ``sweep.json``). Exit 0 when written, 2 when PATH is
neither a store of this runner nor a sweep folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..store_claim import store_attrs
from ..sweep import INDEX, write_index_page
from .run_report import write_report
from .sweep_index import INDEX_PAGE

USAGE_ERROR = 2


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="interp-report", description="(Re)build the HTML report of a store, "
                                     "or the index page of a sweep folder.")
    parser.add_argument("path", type=Path, help="a store (e.g. results.zarr) or a sweep folder (holding sweep.json)")
    parser.add_argument("--out", type=Path, help="the HTML file to write (default: <stem>.report.html beside the "
                                                 f"store, or {INDEX_PAGE} in the sweep folder)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    path = args.path
    if store_attrs(path) is not None:
        written = write_report(path, args.out)
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
