"""The README's own-experiment examples, as written there, compile on a model folder of the user's (tiny_random's
folder, through ``model.path``): found through ``--config-dir`` or ``hydra.searchpath``, with relative paths read from
the current directory; a misspelled name of the user's experiment is explained as the shipped ones are. Dry runs:
no engine starts."""

from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest

from conftest import REPO

pytestmark = pytest.mark.cli

BLOCK = re.compile(r"```(yaml|json)\n(.*?)```", re.DOTALL)


def interp_run(*args, cwd=REPO, env=None):
    """``interp-run ARGS`` as a process of its own."""
    return subprocess.run([str(REPO / ".venv" / "bin" / "interp-run"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=env)


def readme_files() -> dict[str, str]:
    """The README's example files: YAML blocks whose second line names their path, and the facts' JSON line."""
    files = {}
    for lang, body in BLOCK.findall((REPO / "README.md").read_text()):
        lines = body.splitlines()
        if lang == "yaml" and len(lines) > 1 and lines[1].startswith("# my_conf/"):  # after "# @package _global_"
            files[lines[1][2:]] = body
        elif lang == "json":
            json.loads(body)
            files["my_facts.jsonl"] = body
    return files


@pytest.fixture
def user_folder(tmp_path, tiny_path):
    files = readme_files()
    assert {"my_conf/experiment/my_trace.yaml", "my_conf/experiment/my_steer.yaml", "my_facts.jsonl"} <= set(files)
    for name, body in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    hidden = json.loads((tiny_path / "config.json").read_text())["hidden_size"]
    np.save(tmp_path / "calm.npy", np.ones(hidden, dtype=np.float32))
    return tmp_path


def dry_run(folder, *args):
    return interp_run(*args, "dry_run=true", f"hydra.run.dir={folder / 'run'}", cwd=folder)


@pytest.mark.parametrize("find", [["--config-dir", "my_conf"], ["hydra.searchpath=[file://my_conf]"]])
def test_the_users_trace_compiles_on_the_users_model(user_folder, tiny_path, find):
    # tiny_random has 4 layers: the README's window of 6 would not fit it
    proc = dry_run(user_folder, *find, "+experiment=my_trace", f"model.path={tiny_path}", "causal_trace.window=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dry run: config valid" in proc.stdout


def test_the_users_steering_compiles_and_a_misspelled_name_is_explained(user_folder, tiny_path):
    proc = dry_run(user_folder, "--config-dir", "my_conf", "+experiment=my_steer", f"model.path={tiny_path}",
                   "steering.global.base.post_block.layer=1:3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plan: 2 requests" in proc.stdout
    proc = dry_run(user_folder, "--config-dir", "my_conf", "+experiment=my_trce", f"model.path={tiny_path}")
    assert proc.returncode == 2
    assert "config error: experiment: no experiment 'my_trce'" in proc.stderr
    assert "did you mean 'my_trace'?" in proc.stderr
