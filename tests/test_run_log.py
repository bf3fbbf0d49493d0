"""A quiet console and a kept log (``interp_runner.run_log``): ``interp-run`` shows the runner's own lines; vLLM's and
torch's go to ``<store name>.log`` beside the store (from the engine's own processes too) and to Hydra's run-folder
log; ``-v`` shows them on the console; a user's file at the log's place is never replaced."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import textwrap

import pytest
import zarr

from conftest import REPO
from interp_runner.config import ConfigError
from interp_runner.pipeline import run
from support.smoke_process import smoke_process
from test_store import store_config
from test_store_safety import NoEngine

# a vLLM (or torch, in vLLM's format) log line: "INFO 11-26 06:20:32 [file.py:12] ..."; torch's own:
# "W1126 06:20:27..."; either with the prefix vLLM gives its processes' output: "(Worker_TP1 pid=12) "
LIBRARY_LINE = re.compile(r"^(?:\([^)\n]*\) )?"
                          r"(?:(?:DEBUG|INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[|[IW]\d{4} \d\d:\d\d:\d\d\.\d+ )",
                          re.MULTILINE)


def interp_run(*args, cwd=REPO, env=None):
    """``interp-run ARGS`` as a process of its own."""
    return subprocess.run([str(REPO / ".venv" / "bin" / "interp-run"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=env)


@pytest.mark.engine
@pytest.mark.cli
def test_console_shows_the_runner_and_the_log_keeps_every_process(tmp_path_factory):
    """One engine run, its core in a process of its own (as with tensor parallelism): nothing of vLLM's or torch's
    on the console, all of it (the engine core's included) in the log file the store lists beside it. The run is the
    session's one, shared with tests/test_cli.py (``support.smoke_process``)."""
    smoke = smoke_process(tmp_path_factory)
    proc, store, tmp_path = smoke.proc, smoke.store, smoke.folder
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert not LIBRARY_LINE.findall(console), console
    assert "reset prefix cache" not in console and "non-default args" not in console
    assert "Loading safetensors checkpoint shards" not in console  # vLLM's load bar
    for line in ("plan: 3 requests", "engine started on", "stage 0: 3 requests"):
        assert line in proc.stdout, proc.stdout
    log = tmp_path / "smoke.zarr.log"
    for said in (f"store: {store}", f"report: {store}.report.html", f"log: {log}"):
        assert proc.stdout.count(said) == 1, proc.stdout

    text = log.read_text()
    assert "non-default args" in text  # this process's vLLM
    assert "Initializing a V1 LLM engine" in text  # the engine core's process
    assert "Loading weights took" in text  # its worker
    assert text.index("plan: 3 requests") < text.index("non-default args")  # the runner's lines, from its first
    listed = dict(zarr.open_group(str(store), mode="r").attrs)["companions"]
    assert listed["log"] == hashlib.sha256(b"file\0" + log.read_bytes()).hexdigest()
    assert "non-default args" in (tmp_path / "run" / "cli.log").read_text()  # Hydra's run-folder log


@pytest.mark.gpu
@pytest.mark.engine
@pytest.mark.cli
def test_tensor_parallel_workers_log_to_the_file_not_the_console(tmp_path):
    """TP = 2 on two GPUs: both spawned workers' vLLM lines are in the log file, none on the console."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    store = tmp_path / "tp.zarr"
    proc = interp_run("+experiment=steering_smoke", "model=tiny_random", "engine.tensor_parallel_size=2",
                      f"store.path={store}", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert not LIBRARY_LINE.findall(console), console
    text = (tmp_path / "tp.zarr.log").read_text()
    assert re.search(r"world_size=2 rank=0 ", text) and re.search(r"world_size=2 rank=1 ", text), text[-3000:]


def routed(verbose: bool, tmp_path) -> tuple[str, str]:
    """The console and the log file of a process that routes its logs as ``interp-run`` does and logs as vLLM would:
    an INFO line, a dtype cast (notable: said in the runner's words) and an error."""
    log = tmp_path / f"verbose{verbose}.log"
    script = textwrap.dedent(f"""
        import logging
        from interp_runner import run_log
        run_log.install({verbose})
        run_log.begin({str(log)!r})
        import vllm.logger  # configures vLLM's logger from VLLM_LOGGING_CONFIG_PATH, as in every engine process
        logger = logging.getLogger("vllm.config.model")
        logger.info("Resolved architecture: %s", "LlamaForCausalLM")
        logger.warning("Casting %s to %s.", "torch.bfloat16", "torch.float16")
        logger.error("Something failed: %s", "here")
        logging.getLogger("torch._inductor").warning("a torch warning")
        run_log.end()
        logger.info("after the run")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr, log.read_text()


@pytest.mark.cli
def test_quiet_console_says_what_matters_in_the_runners_words(tmp_path):
    console, log = routed(False, tmp_path)
    assert "Resolved architecture" not in console and "a torch warning" not in console
    assert "warning: the model's weights are torch.bfloat16; the engine casts them to torch.float16 " \
           "(engine.dtype)" in console
    assert "vllm error: Something failed: here" in console
    for line in ("Resolved architecture: LlamaForCausalLM", "Casting torch.bfloat16 to torch.float16.",
                 "Something failed: here", "a torch warning"):
        assert line in log
    assert "after the run" not in log  # the run's log is complete once it ended


@pytest.mark.cli
def test_verbose_shows_every_library_line(tmp_path):
    console, log = routed(True, tmp_path)
    assert re.search(r"^INFO \d\d-\d\d [\d:]+ \[<string>:\d+\] Resolved architecture: LlamaForCausalLM$", console,
                     re.MULTILINE), console
    assert "Casting torch.bfloat16 to torch.float16." in console and "a torch warning" in console
    assert "Resolved architecture" in log


@pytest.mark.cli
def test_cli_takes_v_before_hydra_parses(tmp_path):
    """``-v`` is the runner's flag, not an override Hydra would refuse."""
    proc = interp_run("-v", "+experiment=steering_smoke", "model=tiny_random", "dry_run=true",
                      f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dry run: config valid" in proc.stdout


def test_a_users_file_at_the_logs_place_is_never_replaced(tmp_path):
    store = tmp_path / "results.zarr"
    mine = tmp_path / "results.zarr.log"
    mine.write_text("my notes")
    for overwrite in (False, True):
        config = store_config(store={"path": str(store), "overwrite": overwrite})
        with pytest.raises(ConfigError) as err:
            run(config, tmp_path, engine_factory=NoEngine, log=lambda _: None)
        assert err.value.problems[0][0] == "store.path"
        assert f"{mine} is not the store's own" in str(err.value)
    assert mine.read_text() == "my notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.zarr.log"]
