"""``interp-verify``: does a store reproduce? Compare it with a golden store, or rerun it from its own provenance.

    interp-verify STORE --against GOLDEN     compare two finished stores
    interp-verify STORE --rerun [--out DIR]  rerun STORE's resolved config (same model, checked first), compare

Every data variable and coordinate must exist in both stores with the same dims, shape and dtype. Values compare
exactly where both runs share device, kernel path and dtype, otherwise within the tolerances of ``rules`` (which
rule applied, and why, is printed). A rerun on another kernel path is teacher-forced to the store's generated
tokens (``rerun``). Provenance differences are printed as information.

Exit 0 when every result array matches, 1 on any mismatch (a missing or extra array included), 2 when no
comparison could be made (usage, unreadable or unfinished store, an array that cannot be read or whose codec zarr
cannot load, other weights, a config that no longer validates, a rerun that failed).

Modules: ``stores`` (reading a store), ``rules`` (which comparison, what tolerance), ``arrays`` (array by array),
``derived`` (arrays derived from others: the tolerance of their sources), ``report`` (the comparison and its
printout), ``rerun`` (running a store again).

Imports store/, kinds/, engine/ and the pipeline (reruns); nothing imports it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from interp_runner import run_log
from interp_runner.verify.report import Report, compare, print_report
from interp_runner.verify.rerun import rerun, rerun_config
from interp_runner.store.result_arrays import value_kind
from interp_runner.verify.stores import EXIT_ERROR, EXIT_MATCH, EXIT_MISMATCH, Store, VerifyError, check_readable, open_store

__all__ = ["EXIT_ERROR", "EXIT_MATCH", "EXIT_MISMATCH", "Report", "Store", "VerifyError", "compare", "main",
           "open_store", "print_report", "rerun", "rerun_config", "value_kind"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="interp-verify",
        description="Check that a store reproduces: compare it with a golden store (--against) or rerun its "
                    "experiment from its own provenance and compare (--rerun). Exit 0: results match; 1: they "
                    "differ; 2: no comparison possible.",
    )
    ap.add_argument("store", type=Path, metavar="STORE", help="a finished store (results.zarr)")
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--against", type=Path, metavar="GOLDEN", help="the reference store to compare STORE with")
    how.add_argument("--rerun", action="store_true", help="rerun STORE's config and compare the new store with it "
                     "(teacher-forced to its generated tokens where this machine's kernel path is not the store's)")
    ap.add_argument("--out", type=Path, metavar="DIR", help="with --rerun: folder for the new store (kept); default a "
                    "temporary folder, removed when the results match")
    ap.add_argument("--exact", action="store_true", help="compare every value exactly, whatever the devices (a rerun "
                    "then runs free, never teacher-forced)")
    ap.add_argument("-v", "--verbose", action="store_true", help="with --rerun: vLLM's, torch's and transformers' log "
                    "lines on the console too (they always go to the log file beside the rerun's store)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as stop:  # argparse exits 2 on usage errors, 0 for --help
        return int(stop.code or 0)
    if args.out is not None and not args.rerun:
        print("interp-verify: error: --out needs --rerun", file=sys.stderr)
        return EXIT_ERROR
    temporary = None
    try:
        store = open_store(args.store)
        if args.rerun:
            check_readable(store)  # before spending a run on it
            out = args.out
            if out is None:
                out = temporary = Path(tempfile.mkdtemp(prefix="interp-verify-"))
            run_log.install(args.verbose)  # a quiet console, as interp-run's
            new, ref = open_store(rerun(store, out, log=run_log.say, exact=args.exact)), store
        else:
            new, ref = store, open_store(args.against)
        report = compare(new, ref, exact=args.exact)
    except VerifyError as err:
        print(f"interp-verify: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    print()
    print_report(report)
    if temporary is not None:
        if report.ok:
            shutil.rmtree(temporary, ignore_errors=True)
        else:
            print(f"\nthe rerun's store is kept for inspection: {temporary / 'results.zarr'}")
    return EXIT_MATCH if report.ok else EXIT_MISMATCH
