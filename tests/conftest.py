"""Shared fixtures. Engines are expensive on CPU: one per (model, mode) for the whole session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

REPO = Path(__file__).resolve().parent.parent


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    from interp_runner.models.materialize import model_path

    return model_path("tiny_random")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from interp_runner.models.materialize import model_path

    return model_path("smollm2_135m")


def base_config(model: str = "tiny_random", **overrides) -> dict:
    """A minimal valid run config (plain dict, as Hydra would hand it over)."""
    cfg = {
        "model": {"name": model},
        "engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "max_num_seqs": 16},
        "prompts": {"items": ["The Eiffel Tower is located in the city of", "Hello, my name is"]},
        "sampling": {"max_tokens": 4},
    }
    cfg.update(overrides)
    return cfg
