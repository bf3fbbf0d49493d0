"""Static HTML reports: one beside every store (``run_report``), an index page per sweep (``sweep_index``), and
``interp-report`` to (re)build either (``cli``). Each page is one self-contained file that opens offline.
Imports kinds/, store/ and the sweep index; nothing imports it but the CLI and the pipeline's last step."""

from interp_runner.report.run_report import write_report

__all__ = ["write_report"]
