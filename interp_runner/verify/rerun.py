"""``--rerun``: run a store's experiment again from its own provenance, on this machine, for comparison.

Where this machine's kernel path is the store's, the rerun runs as recorded and must match exactly. Elsewhere a
greedy continuation may legitimately fork at a near tie, so the rerun's generated tokens are teacher-forced to the
store's (``sampling.teacher_forcing``, recorded in the rerun's config): every generated position then holds the
same tokens, and their log-probabilities, top-k and captures compare within the tolerance of ``rules``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path

from interp_runner.verify.rules import kernel_path, path_differences
from interp_runner.verify.stores import Store, VerifyError


def _remap_experiments_dir(config, recorded: str | None, here: str, log: Callable[[str], None]):
    """Paths under the recorded checkout's ``experiments/`` read from this checkout's, so a store made elsewhere
    (a golden store in CI) reruns with the experiment data of the code being verified."""
    if not recorded or recorded == here:
        return config

    def walk(value):
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, str) and (value == recorded or value.startswith(recorded.rstrip("/") + "/")):
            return here + value[len(recorded.rstrip("/")):]
        return value

    remapped = walk(config)
    if remapped != config:
        log(f"paths under {recorded} read from {here}")
    return remapped


def rerun_config(store: Store, new_store: Path, log: Callable[[str], None] = print) -> dict:
    """The store's resolved config, writing to ``new_store``; refuses (VerifyError) other model weights."""
    from interp_runner.config import ConfigError
    from interp_runner.config.schema import resolve_path
    from interp_runner.models.facts import weights_sha256
    from interp_runner.models.materialize import model_path
    from interp_runner.store.provenance import EXPERIMENTS_DIR
    from interp_runner.config.run import validate_config

    config = store.config
    if not config:
        raise VerifyError(f"{store.path}: no config_yaml in its provenance")
    config = _remap_experiments_dir(config, store.attrs.get("experiments_dir"), str(EXPERIMENTS_DIR), log)
    config["store"] = {**(config.get("store") or {}), "path": str(new_store)}
    config["dry_run"] = False
    try:
        cfg = validate_config(config)
    except ConfigError as err:
        raise VerifyError(f"{store.path}: its config no longer validates:\n  {err}".replace("\n", "\n  ")) from None
    if cfg.model.path:
        folder = resolve_path(cfg.model.path, Path.cwd())
    else:
        try:
            folder = model_path(cfg.model.name)
        except FileNotFoundError as err:
            raise VerifyError(f"model {cfg.model.name!r}: {err}") from None
    recorded = (store.attrs.get("model") or {}).get("weights_sha256")
    current = weights_sha256(folder) if (folder / "config.json").exists() else None
    if current is None:
        raise VerifyError(f"model folder {folder} is missing (config.json not found)")
    if recorded != current:
        raise VerifyError(
            f"{store.path} was made with model weights sha256 {recorded}; the rerun would load {folder} with "
            f"{current}: refusing to compare runs of different models"
        )
    return config


def forcing_reason(store: Store) -> str | None:
    """Why a rerun of ``store`` on this machine is teacher-forced to its tokens; None where it runs as recorded
    (the same kernel path: it must match exactly) or has no text to force."""
    from interp_runner.store.provenance import host, versions

    config = store.config
    if "tokens" not in store.ds.data_vars:  # the store has no generated tokens
        return None
    # the dtype resolves as the store's did: the configured one, or "auto" on the same kernel path
    here = {"host": host(), "versions": versions(), "engine": {"dtype": store.compute_dtype}}
    differ = path_differences(kernel_path(here), kernel_path(store.attrs))
    batch_invariant = bool((config.get("engine") or {}).get("batch_invariant"))
    if not differ and (not here["host"]["gpus"] or batch_invariant):
        return None
    if not differ:
        return "GPU runs without engine.batch_invariant"
    return "this machine's kernel path is not the store's: " + "; ".join(differ)


def rerun(store: Store, out: Path, log: Callable[[str], None] = print, exact: bool = False) -> Path:
    """Rerun ``store``'s experiment into ``out``/results.zarr; the new store's path. Teacher-forced to the store's
    tokens where this machine's kernel path differs (never with ``exact``)."""
    from interp_runner.config import ConfigError
    from interp_runner.pipeline import run

    new_store = (out / "results.zarr").resolve()
    if new_store == store.path.resolve() or store.path.resolve() in new_store.parents:
        raise VerifyError(f"--out {out} would overwrite {store.path}")
    config = rerun_config(store, new_store, log)
    overrides = [*(store.attrs.get("overrides") or []), f"store.path={new_store}"]  # as the rerun really ran
    reason = None if exact else forcing_reason(store)
    if reason is not None:
        source = str(store.path.resolve())
        config["sampling"] = {**(config.get("sampling") or {}), "teacher_forcing": source}
        overrides.append(f"sampling.teacher_forcing={source}")
        log(f"generated tokens teacher-forced to the store's ({reason})")
    log(f"rerunning {store.path} ({(store.attrs.get('experiment') or {}).get('name')}) into {new_store}")
    try:
        path = run(config, out, overrides=overrides, log=log)
    except ConfigError as err:
        raise VerifyError(f"{store.path}: its config is refused:\n  {err}".replace("\n", "\n  ")) from None
    except Exception as err:  # the run itself failed: nothing to compare
        traceback.print_exc()
        raise VerifyError(f"rerun failed: {type(err).__name__}: {err}") from err
    return path
