"""What a user sees while a run goes: progress per stage (a bar on a terminal, plain lines elsewhere), the engine
start broken into phases, and `python -m interp_runner` behaving as `interp-run`."""

from __future__ import annotations

import logging
import subprocess

import pytest
import zarr

from conftest import REPO
from support import inprocess
from interp_runner.engine.startup import StartupPhases, describe
from interp_runner.progress import StageProgress

TRACE = (
    "+experiment=causal_trace", "model=tiny_random", "causal_trace.num_facts=2", "causal_trace.noise.samples=1",
    "causal_trace.window=2", "causal_trace.layers=[0,3]", "causal_trace.filter=false", "causal_trace.plots=false",
    "store.unit_requests=8",
)


def test_without_a_terminal_a_stage_prints_one_plain_line_per_unit():
    lines = []
    progress = StageProgress("stage 1", 10, lines.append, bar=False)
    for unit, size in enumerate((4, 4, 2)):
        progress.advance(size)
        progress.unit_finished(unit, 3)
    progress.close()
    assert len(lines) == 3
    assert lines[0].startswith("stage 1: unit 1/3, 4/10 requests") and "ETA" in lines[0]
    assert lines[-1].startswith("stage 1: unit 3/3, 10/10 requests")
    assert not any("\r" in line for line in lines)


def test_startup_phases_are_read_from_vllms_own_timing_records():
    announced = []
    logger = logging.getLogger("vllm.model_executor.model_loader.default_loader")
    with StartupPhases(announce=announced.append) as phases:
        logger.info("Loading weights took %.2f seconds", 0.25)
        logging.getLogger("vllm.compilation.monitor").info("torch.compile took %.2f s in total", 12.5)
        logging.getLogger("vllm.compilation.decorators").info("saved AOT compiled function to %s", "/x")
        logging.getLogger("vllm.compilation.monitor").info("Initial profiling/warmup run took %.2f s", 3.0)
        logging.getLogger("vllm.v1.worker").info("Graph capturing finished in %.0f secs, took %.2f GiB", 7, 0.5)
        logging.getLogger("other").info("Loading weights took %.2f seconds", 99.0)  # not vLLM's
    summary = phases.summary(compiled=True)
    assert summary["load_s"] == 0.25 and summary["compile_s"] == 12.5 and summary["profile_s"] == 3.0
    assert summary["graphs_s"] == 7.0 and summary["compile_cache"] == "miss"
    assert any("weights loaded" in line for line in announced)
    assert "compile cache miss" in describe(summary)
    with StartupPhases() as warm:
        logging.getLogger("vllm.compilation.decorators").info("Directly load AOT compilation from path %s", "/x")
    assert warm.summary(compiled=True)["compile_cache"] == "hit"
    assert StartupPhases().summary(compiled=False)["compile_cache"] == "not compiled"


@pytest.mark.cli
def test_python_dash_m_is_interp_run():
    for module in ("interp_runner", "interp_runner.cli"):
        proc = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", module, "+experiment=steering_smoke",
                               "model=tiny_random", "dry_run=true"], cwd=REPO, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "dry run: config valid, requests sha256" in proc.stdout, module


@pytest.mark.cli
def test_python_dash_m_leaves_the_working_directory_off_the_import_path(tmp_path):
    # a folder named as a package that transformers probes for, in the working directory (the repository's kernels/)
    marker = tmp_path / "imported"
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    python = str(REPO / ".venv" / "bin" / "python")
    subprocess.run([python, "-c", "import kernels"], cwd=tmp_path, check=True)
    assert marker.exists()  # found there by a plain `python -c`
    marker.unlink()
    proc = subprocess.run([python, "-m", "interp_runner", *TRACE,
                           "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dry run: config valid" in proc.stdout
    assert not marker.exists()  # the tokenizer's transformers import did not find it


@pytest.mark.engine
def test_a_run_logs_progress_and_records_its_phases(tmp_path):
    store = tmp_path / "trace.zarr"
    # through the CLI's main in this process, on an engine of its own: the run starts it (``support.inprocess``)
    proc = inprocess.interp_run(*TRACE, f"store.path={store}", f"hydra.run.dir={tmp_path / 'run'}", engines=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    units = [line for line in out.splitlines() if line.startswith("stage 1: unit ")]
    done, total = units[-1].split(", ")[1].split()[0].split("/")
    assert len(units) >= 2 and done == total  # the last unit's line says every request is done
    assert "engine start: " in out and "eager" in out  # eager on a CPU by default
    attrs = dict(zarr.open_group(str(store), mode="r").attrs)
    startup = attrs["engine"]["startup"]
    assert startup["compiled"] is False and startup["total_s"] > 0 and "load_s" in startup
    assert set(attrs["timings"]) == {"plan_s", "engine_s", "run_s", "store_s", "figures_s", "exports_s"}
    assert "\r" not in out
