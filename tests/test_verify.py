"""``interp-verify``: a store against itself and its rerun, perturbed and refused stores, provenance as information,
reruns on another CPU kernel path (teacher-forced, within tolerance, yet failing on a real change); the tolerance
rules on small hand-made stores are in test_verify_tolerance.py.

Three engine starts in all, at most: the store (``interp-run`` on tiny_random, on the session's shared engine) and
its rerun (``interp-verify --rerun``), both through their ``main`` in this process (``support.inprocess``), and the
reruns of the store and of a changed copy in one process of its own with oneDNN's GEMMs capped to SSE4.1
(``ONEDNN_MAX_CPU_ISA``, read once per process): other kernels, other float32 sums.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import yaml
import zarr

from conftest import REPO
from interp_runner import verify
from interp_runner.engine.kernel_path import CPU_KERNEL_KEYS, KERNEL_ENV
from interp_runner.verify import EXIT_ERROR, EXIT_MATCH, EXIT_MISMATCH, main
from support.inprocess import Completed, interp_run, interp_verify
from support.rerun_process import verify_reruns

PERTURBED = (1, 1, 2, 0, 17)  # request, last_hook, last_layer, last_slot, hidden
OTHER_KERNELS = {"ONEDNN_MAX_CPU_ISA": "SSE41"}  # this CPU computing as one without AVX2 would (GEMMs)


def set_attrs(path: Path, **attrs) -> None:
    zarr.open_group(str(path), mode="r+").attrs.update(attrs)


def attrs_of(path: Path) -> dict:
    return dict(zarr.open_group(str(path), mode="r").attrs)


def run_verify(capsys, *args) -> tuple[int, str, str]:
    """interp-verify's exit status, stdout and stderr. A rerun goes as a process of its own would (``interp_verify``):
    it routes the process's logging as the tool does, which later tests in this process must not inherit."""
    if "--rerun" in args:
        proc = interp_verify(*args)
        return proc.returncode, proc.stdout, proc.stderr
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------------------------ a real store and its rerun


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("verify")
    path = tmp / "smoke.zarr"
    proc = interp_run("+experiment=steering_smoke", "model=tiny_random", "engine=eager", f"store.path={path}",
                      f"hydra.run.dir={tmp / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


@pytest.fixture(scope="module")
def rerun(store, tmp_path_factory) -> tuple[Completed, Path]:
    out = tmp_path_factory.mktemp("rerun")
    return interp_verify(store, "--rerun", "--out", out), out / "results.zarr"


@pytest.fixture(scope="module")
def other_kernels_reruns(store, tmp_path_factory) -> dict[str, tuple[Completed, Path]]:
    """Reruns on other kernels, in one process: ``store``'s, and that of a copy of it (``changed``) whose decode
    steering of prompt 2 is scaled by 1.1 instead of 1."""
    tmp = tmp_path_factory.mktemp("other-kernels")
    changed = copy(store, tmp, "changed.zarr")
    config = yaml.safe_load(attrs_of(changed)["config_yaml"])
    config["steering"]["request"][1]["decode"]["pre_attn"]["scale"] = -1.1
    set_attrs(changed, config_yaml=yaml.safe_dump(config, sort_keys=True))
    outs = {"store": tmp / "store", "changed": tmp / "changed"}
    procs = verify_reruns([(store, outs["store"]), (changed, outs["changed"])], tmp / "reruns.json", **OTHER_KERNELS)
    return {name: (proc, outs[name] / "results.zarr") for name, proc in zip(outs, procs)}


@pytest.fixture(scope="module")
def other_kernels_rerun(other_kernels_reruns) -> tuple[Completed, Path]:
    return other_kernels_reruns["store"]


def copy(store: Path, tmp_path: Path, name: str = "copy.zarr") -> Path:
    target = tmp_path / name
    shutil.copytree(store, target)
    return target


@pytest.mark.engine
def test_store_matches_itself(store, capsys):
    code, out, _ = run_verify(capsys, store, "--against", store)
    assert code == EXIT_MATCH, out
    assert "comparison: exact (same kernel path: CPU " in out and "OK: all 24 arrays match" in out
    assert "provenance differences" not in out
    attrs = attrs_of(store)
    assert set(CPU_KERNEL_KEYS) <= set(attrs["host"]["cpu"]) and attrs["host"]["cpu"]["threads"] >= 1
    assert attrs["engine"]["dtype"] == "float32"  # the experiment's, on every CPU


@pytest.mark.engine
def test_rerun_reproduces_bit_for_bit(rerun, store, capsys):
    proc, new = rerun
    assert proc.returncode == EXIT_MATCH, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK: all 24 arrays match" in proc.stdout and "comparison: exact (same kernel path" in proc.stdout
    assert "teacher-forced" not in proc.stdout
    # a quiet console, as interp-run's: vLLM's lines go to the log file beside the rerun's store
    assert "engine started" in proc.stdout and "Resolved architecture" not in proc.stdout + proc.stderr
    assert "Resolved architecture" in (new.parent / f"{new.name}.log").read_text()
    attrs = dict(zarr.open_group(str(new), mode="r").attrs)
    assert attrs["status"] == "complete" and "--rerun" in attrs["command"]
    # only where the store went differs in the config
    assert f"config.store.path: '{store}' -> '{new}'" in proc.stdout
    # and the rerun's store compares equal the other way round too
    code, out, _ = run_verify(capsys, new, "--against", store)
    assert code == EXIT_MATCH, out


@pytest.mark.engine
def test_perturbed_value_fails_and_names_the_array_and_index(store, tmp_path, capsys):
    perturbed = copy(store, tmp_path)
    last = zarr.open_group(str(perturbed), mode="r+")["last"]
    last[PERTURBED] = last[PERTURBED] + 0.5
    code, out, _ = run_verify(capsys, perturbed, "--against", store)
    assert code == EXIT_MISMATCH, out
    assert "MISMATCH: 1 of 24 arrays in both stores differ" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("last "))
    assert "request=1 ('r00001'), last_hook=1 ('post_block'), last_layer=2 (2), last_slot=0, hidden=17" in row
    assert " 0.5 " in row and "1 of 3072 elements differ" in row


@pytest.mark.engine
def test_missing_array_and_changed_token_fail(store, tmp_path, capsys):
    changed = copy(store, tmp_path)
    shutil.rmtree(changed / "text")
    tokens = zarr.open_group(str(changed), mode="r+")["tokens"]
    tokens[2, 3] = tokens[2, 3] + 1
    code, out, _ = run_verify(capsys, changed, "--against", store)
    assert code == EXIT_MISMATCH, out
    assert "1 in only one store" in out
    assert any(line.split()[:1] == ["text"] and "missing from copy.zarr" in line for line in out.splitlines())
    row = next(line for line in out.splitlines() if line.strip().startswith("tokens "))
    assert "request=2 ('r00002'), generated=3" in row and "exact" in row


@pytest.mark.engine
def test_unfinished_store_is_refused(store, tmp_path, capsys, monkeypatch):
    failed = copy(store, tmp_path)
    set_attrs(failed, status="failed", error="RuntimeError: boom")
    monkeypatch.setattr("interp_runner.pipeline.run", lambda *a, **k: pytest.fail("the rerun must not start"))
    code, _, err = run_verify(capsys, failed, "--rerun", "--out", tmp_path / "out")
    assert code == EXIT_ERROR
    assert "status is 'failed', not 'complete': RuntimeError: boom" in err
    code, _, err = run_verify(capsys, store, "--against", failed)
    assert code == EXIT_ERROR and "status is 'failed'" in err


@pytest.mark.engine
def test_other_model_weights_are_refused_before_running(store, tmp_path, capsys, monkeypatch):
    other = copy(store, tmp_path)
    model = dict(zarr.open_group(str(other), mode="r").attrs["model"])
    set_attrs(other, model={**model, "weights_sha256": "0" * 64})
    monkeypatch.setattr("interp_runner.pipeline.run", lambda *a, **k: pytest.fail("the rerun must not start"))
    code, _, err = run_verify(capsys, other, "--rerun", "--out", tmp_path / "out")
    assert code == EXIT_ERROR
    assert f"weights sha256 {'0' * 64}" in err and model["weights_sha256"] in err


@pytest.mark.engine
def test_provenance_differences_are_shown_but_do_not_fail(store, tmp_path, capsys):
    moved = copy(store, tmp_path)
    attrs = dict(zarr.open_group(str(moved), mode="r").attrs)
    set_attrs(
        moved,
        versions={**attrs["versions"], "torch": "9.9.9"},
        host={**attrs["host"], "hostname": "elsewhere"},
        package={**attrs["package"], "git_sha": "f" * 40},
        plugin={**attrs["plugin"], "fingerprint": "0123456789abcdef"},
        requests_sha256="1" * 64,
    )
    code, out, _ = run_verify(capsys, moved, "--against", store)
    assert code == EXIT_MATCH, out
    assert "tolerant (CPU runs on other kernel paths: torch: '2.11.0' -> '9.9.9')" in out
    for line in ("versions.torch: '2.11.0' -> '9.9.9'", "host.hostname:", "'elsewhere'",
                 f"package.git_sha: {attrs['package']['git_sha']!r} -> '{'f' * 40}'",
                 "plugin.fingerprint:", "requests_sha256:"):
        assert line in out
    assert "OK: all 24 arrays match" in out


@pytest.mark.engine
def test_rerun_on_other_kernels_is_teacher_forced_and_within_tolerance(other_kernels_rerun, store):
    proc, new = other_kernels_rerun
    out = proc.stdout
    assert proc.returncode == EXIT_MATCH, out[-3000:] + proc.stderr[-3000:]
    env = attrs_of(store)["host"]["cpu"]["env"]  # the store's own (a test worker's may hold OMP_NUM_THREADS)
    merged = {**env, **OTHER_KERNELS}
    change = f"cpu.env: {env!r} -> { {name: merged[name] for name in KERNEL_ENV if name in merged}!r}"
    assert f"generated tokens teacher-forced to the store's (this machine's kernel path is not the store's: {change})" \
        in out
    assert f"comparison: tolerant (CPU runs on other kernel paths: {change})" in out
    # the numbers really moved (other float32 sums), within the tolerance
    tolerated = out.split("within tolerance:")[1].split("OK:")[0].splitlines()
    last = next(line for line in tolerated if line.split()[:1] == ["last"])
    assert "(rtol 0.0001 (CPU float32) x scale)" in last
    assert "OK: all 24 arrays match (within tolerance)" in out
    assert yaml.safe_load(attrs_of(new)["config_yaml"])["sampling"]["teacher_forcing"] == str(store.resolve())
    assert attrs_of(new)["host"]["cpu"]["env"] == {**env, **OTHER_KERNELS}
    tokens = [xr.open_zarr(str(path), consolidated=False)["tokens"] for path in (new, store)]
    np.testing.assert_array_equal(*tokens)


@pytest.mark.engine
def test_rerun_on_other_kernels_still_fails_on_a_real_change(other_kernels_reruns):
    """Decode steering of prompt 2 scaled by 1.1 instead of 1: its forced tokens' log-probabilities move beyond the
    tolerance, while its first token (before any decode steering) does not."""
    proc, _ = other_kernels_reruns["changed"]
    assert proc.returncode == EXIT_MISMATCH, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "teacher-forced" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.strip().startswith("logprob "))
    assert "request=2 ('r00002')" in row and "beyond tolerance" in row


@pytest.mark.engine
def test_teacher_forced_comparison_catches_a_changed_value(other_kernels_rerun, store, tmp_path, capsys):
    _, new = other_kernels_rerun
    changed = copy(new, tmp_path)  # still forced to ``store``'s tokens
    logprob = zarr.open_group(str(changed), mode="r+")["logprob"]
    logprob[0, 3] = logprob[0, 3] - 0.01
    code, out, _ = run_verify(capsys, changed, "--against", store)
    assert code == EXIT_MISMATCH and "teacher-forced" in out
    rows = [line for line in out.split("MISMATCH")[1].splitlines() if line.strip()]
    assert any(line.split()[0] == "logprob" and "request=0 ('r00000'), generated=3" in line for line in rows)
    # the forced token is now below its step's top beyond the tolerance: a free rerun would have forked
    assert any(line.split()[0] == "tokens" and "no longer the greedy choice" in line for line in rows), out


@pytest.mark.engine
def test_corrupted_chunk_exits_2_naming_the_array(store, tmp_path, capsys, monkeypatch):
    broken = copy(store, tmp_path)
    (broken / "last" / "c" / "1" / "0" / "0" / "0" / "0").write_bytes(b"not an lz4 block" * 8)
    code, out, err = run_verify(capsys, broken, "--against", store)
    assert code == EXIT_ERROR and f"{broken}: array 'last' cannot be read" in err, err
    assert "Traceback" not in err + out
    monkeypatch.setattr("interp_runner.pipeline.run", lambda *a, **k: pytest.fail("the rerun must not start"))
    code, out, err = run_verify(capsys, broken, "--rerun", "--out", tmp_path / "out")
    assert code == EXIT_ERROR and "array 'last' cannot be read" in err and "Traceback" not in err + out


def test_rerun_reads_experiment_data_from_this_checkout(tmp_path):
    """A store made in another checkout (a golden store in CI) reruns with this checkout's experiments/ folder."""
    from interp_runner.store.provenance import EXPERIMENTS_DIR

    elsewhere = copy(REPO / "experiments" / "golden" / "causal_trace.zarr", tmp_path)
    attrs = dict(zarr.open_group(str(elsewhere), mode="r").attrs)
    set_attrs(elsewhere, experiments_dir="/elsewhere/experiments",
              config_yaml=attrs["config_yaml"].replace(attrs["experiments_dir"], "/elsewhere/experiments"))
    logged = []
    config = verify.rerun_config(verify.open_store(elsewhere), tmp_path / "new.zarr", logged.append)
    assert config["causal_trace"]["facts"] == str(EXPERIMENTS_DIR / "causal_trace" / "facts.jsonl")
    assert config["store"]["path"] == str(tmp_path / "new.zarr")
    assert logged == [f"paths under /elsewhere/experiments read from {EXPERIMENTS_DIR}"]


def test_teacher_forcing_takes_the_tokens_of_a_store_of_the_same_requests():
    from interp_runner.config import ConfigError
    from interp_runner.payload import unpack_positions
    from interp_runner.pipeline import prepare

    golden = REPO / "experiments" / "golden" / "steering_smoke.zarr"
    config = yaml.safe_load(attrs_of(golden)["config_yaml"])
    config["sampling"]["teacher_forcing"] = str(golden)
    plan = prepare(config).plan
    assert plan.engine_spec.force_tokens
    tokens = xr.open_zarr(str(golden), consolidated=False)["tokens"].values
    for i, request in enumerate(plan.requests):
        assert unpack_positions(request.payload.force).tolist() == [t for t in tokens[i] if t >= 0]
    config["prompts"]["items"][2]["text"] = "Once upon a midnight dreary"
    with pytest.raises(ConfigError, match="request r00002 of .* had another prompt"):
        prepare(config)
    trace = yaml.safe_load(attrs_of(REPO / "experiments" / "golden" / "causal_trace.zarr")["config_yaml"])
    trace["sampling"]["teacher_forcing"] = str(golden)
    with pytest.raises(ConfigError, match="a causal trace generates no text to force"):
        prepare(trace)


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main([]) == EXIT_ERROR
    assert main([str(tmp_path / "x.zarr")]) == EXIT_ERROR  # neither --against nor --rerun
    code, _, err = run_verify(capsys, tmp_path / "missing.zarr", "--against", tmp_path / "other.zarr")
    assert code == EXIT_ERROR and "not a readable zarr store" in err


# ------------------------------------------------------------------ the engine option


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU behaviour")
def test_batch_invariant_is_refused_on_cpu(tiny_path):
    """A config error (the CLI exits 2) before vLLM is even imported."""
    from interp_runner.config import ConfigError
    from interp_runner.config.schema import EngineConfig
    from interp_runner.engine.adapter import VllmEngine
    from interp_runner.payload import EngineSpec

    with pytest.raises(ConfigError) as err:
        VllmEngine(str(tiny_path), EngineConfig(batch_invariant=True), EngineSpec((), (), (), 0))
    (path, reason), = err.value.problems
    assert path == "engine.batch_invariant" and "needs a GPU" in reason


def test_batch_invariant_mode_cannot_change_within_a_process(monkeypatch):
    from interp_runner.engine import settings as engine

    monkeypatch.setattr(engine, "on_gpu", lambda: True)
    monkeypatch.setattr(engine, "_batch_invariant_in_process", None)
    monkeypatch.setenv(engine.BATCH_INVARIANT_ENV, "1")  # the config decides, not the environment
    engine.set_batch_invariant(False)
    assert engine.os.environ[engine.BATCH_INVARIANT_ENV] == "0"
    with pytest.raises(engine.EngineError, match="cannot switch the mode within a process"):
        engine.set_batch_invariant(True)
