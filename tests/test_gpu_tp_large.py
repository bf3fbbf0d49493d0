"""Tensor parallelism at 4 and 8 GPUs on a Llama-3-70B-shaped model with seeded random weights, compiled with CUDA
graphs (skipped with fewer than 4 GPUs).

Seeded weights (``model.weights: seeded``) are the same tensors at every TP size, so runs at different sizes are
comparable. Each TP size runs in its own process (vLLM starts TP workers with spawn), its jobs on one engine per
model and dtype:

- the 70B shape (80 layers) at TP = 4: ``steering_smoke`` (every steering tier, capture at prompt and generated
  positions) plus a zero-source patch, bfloat16; every rank records the same intervention checksum;
- TP = 4 against TP = 2 on a 70B-*width* model of 8 layers (the full model in bfloat16 is 141 GB: 70 GB a GPU at
  TP = 2 leaves no room for anything else on an 80 GB card): bfloat16 teacher-forced to TP = 2's tokens, each float
  array within 4 times what bfloat16 itself costs (TP = 2 bfloat16 against float32 forced to the same tokens);
- with 8 GPUs, the 70B shape at TP = 8 against TP = 4 the same way (the float32 reference at TP = 8: 35 GB a GPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import yaml

from conftest import REPO
from support.tp_jobs import compiled, ranks_agree, report, run_jobs, within_bf16

pytestmark = [pytest.mark.gpu, pytest.mark.engine, pytest.mark.slow]

SEED = 0
WIDTH_LAYERS = 8

def engine(tp: int, dtype: str) -> dict:
    return {"dtype": dtype, "enforce_eager": dtype == "float32",  # the float32 reference need not be compiled
            "max_model_len": 1024, "max_num_seqs": 16, "tensor_parallel_size": tp, "gpu_memory_utilization": 0.88}


def smoke(folder: Path, tp: int, dtype: str, store: Path, forced: Path | None = None) -> dict:
    cfg = yaml.safe_load((REPO / "conf" / "experiment" / "steering_smoke.yaml").read_text())
    cfg.update(model={"name": folder.name, "path": str(folder), "weights": "seeded", "seed": SEED},
               engine=engine(tp, dtype), store={"path": str(store)},
               patching=[{"prompts": [0], "source": {"zeros": True}, "hook": "attn_out", "layers": [1],
                          "alpha": 0.5}])
    if forced is not None:
        cfg["sampling"] = {**cfg["sampling"], "teacher_forcing": str(forced)}
    return cfg


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, xr.Dataset]:
    import torch

    from interp_runner.models.seeded import llama70b_folder

    gpus = torch.cuda.device_count()
    if gpus < 4:
        pytest.skip(f"needs 4 GPUs (this machine has {gpus})")
    tmp = tmp_path_factory.mktemp("tp_large")
    big, width = llama70b_folder(tmp / "llama70b"), llama70b_folder(tmp / "llama70b_w8", WIDTH_LAYERS)
    names = ["w8_bf16_2", "w8_fp32_forced_2", "w8_bf16_forced_4", "big_bf16_4"]
    if gpus >= 8:
        names += ["big_bf16_forced_8", "big_fp32_forced_8"]
    s = {name: tmp / f"{name}.zarr" for name in names}
    run_jobs(tmp, 2, [(smoke(width, 2, "bfloat16", s["w8_bf16_2"]), tmp / "r1"),
                      (smoke(width, 2, "float32", s["w8_fp32_forced_2"], forced=s["w8_bf16_2"]), tmp / "r2")],
             timeout=1800, report=report)
    run_jobs(tmp, 4, [(smoke(width, 4, "bfloat16", s["w8_bf16_forced_4"], forced=s["w8_bf16_2"]), tmp / "r3"),
                      (smoke(big, 4, "bfloat16", s["big_bf16_4"]), tmp / "r4")],
             timeout=1800, report=report)
    if gpus >= 8:
        run_jobs(tmp, 8, [(smoke(big, 8, "bfloat16", s["big_bf16_forced_8"], forced=s["big_bf16_4"]), tmp / "r5"),
                          (smoke(big, 8, "float32", s["big_fp32_forced_8"], forced=s["big_bf16_4"]), tmp / "r6")],
                 timeout=1800, report=report)
    return {name: xr.open_zarr(path, consolidated=False) for name, path in s.items()}


def test_70b_tp4_steering_capture_patching_ranks_agree(stores):
    ds = stores["big_bf16_4"]
    assert compiled(ds) and ds.attrs["status"] == "complete"
    assert ds.attrs["model"]["num_layers"] == 80 and ds.attrs["model"]["hidden_size"] == 8192
    ranks_agree(ds, 4)
    # not vacuous: captures came back at prompt and generated positions, finite, and the patch moved its request
    assert np.isfinite(ds["last"].values).sum() > 0 and np.isfinite(ds["gen"].values).sum() > 0
    assert not ds["nonfinite"].values.any()
    role = list(ds["role"].values)
    patched, baseline = role.index("patched"), role.index("baseline")
    moved, unpatched = ds["logprob"].values[patched], ds["logprob"].values[baseline]
    assert np.isfinite(moved).all() and np.isfinite(unpatched).all() and not np.array_equal(moved, unpatched)
    report(f"70B TP=4 bfloat16 compiled: steering_smoke + patch, 4 ranks' checksums equal "
           f"({json.loads(json.dumps(ds.attrs['engine']['intervention_checksums']))[0]['steps']} steps)")


def test_70b_width_tp4_matches_tp2_within_bf16(stores):
    one, two, ref = stores["w8_bf16_2"], stores["w8_bf16_forced_4"], stores["w8_fp32_forced_2"]
    assert compiled(one) and compiled(two)
    ranks_agree(one, 2)
    ranks_agree(two, 4)
    lines = within_bf16(one, two, ref)
    report(f"70B-width {WIDTH_LAYERS}-layer TP=4 vs TP=2 bfloat16, teacher-forced: {len(lines)} arrays within 4x "
           f"bf16's cost ({', '.join(lines)})")


def test_70b_tp8_matches_tp4_within_bf16(stores):
    if "big_bf16_forced_8" not in stores:
        pytest.skip("needs 8 GPUs")
    one, two, ref = stores["big_bf16_4"], stores["big_bf16_forced_8"], stores["big_fp32_forced_8"]
    assert compiled(one) and compiled(two)
    ranks_agree(two, 8)
    lines = within_bf16(one, two, ref)
    report(f"70B TP=8 vs TP=4 bfloat16, teacher-forced: {len(lines)} arrays within 4x bf16's cost "
           f"({', '.join(lines)})")
