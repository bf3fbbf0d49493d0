"""Seeded random weights: a checkpoint that exists only as a function of (seed, tensor name).

A model folder needs only config.json and tokenizer files. Its checkpoint tensors are named and shaped as the
HF model class of the config holds them (built on the meta device: no memory), tied embeddings as the config
says. Element ``i`` of tensor ``name`` is a hash of (seed, name, i) mapped to a uniform value of standard
deviation ``INIT_STD``; 1-D norm weights are ones. The hash is integer arithmetic without overflow and the
mapping two correctly rounded float64 operations, each a separate torch op, so the values are the same bits on
a CPU and a GPU, in any chunking: every tensor-parallel rank builds the same full tensor and keeps its shard, so
TP = 1, 2, 4 and 8 hold the same weights, and any rows (``embedding_rows``) can be drawn alone.

vLLM loads such a model with the ``interp_seeded`` load format (``interp_runner.plugin.seeded_loader``).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

LOAD_FORMAT = "interp_seeded"
SCHEME = "interp-seeded-v1"  # changes whenever the values a (seed, name) gives change
INIT_STD = 0.02
CHUNK = 1 << 24  # elements drawn at a time on a GPU (int64 temporaries of 128 MiB: few kernel launches)
CPU_CHUNK = 1 << 16  # on a CPU: temporaries of 512 KiB stay in cache (~10x faster than 128 MiB ones)
_M32, _M16 = 0xFFFFFFFF, 0xFFFF

# Llama-3-70B's config.json (meta-llama/Meta-Llama-3-70B), tokenizer ids aside
LLAMA3_70B = dict(
    hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
    intermediate_size=28672, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}, hidden_act="silu", attention_bias=False,
    attention_dropout=0.0, mlp_bias=False, tie_word_embeddings=False, initializer_range=0.02,
)


def weights_id(seed: int) -> str:
    """What provenance records in place of a weights file hash."""
    return f"{SCHEME}:seed={seed}:std={INIT_STD}"


def tensor_key(seed: int, name: str) -> tuple[int, int]:
    digest = hashlib.sha256(f"{SCHEME}:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")


def _mul32(h, c: int):
    """(h * c) mod 2**32 for int64 h in [0, 2**32), exact: no intermediate reaches 2**49."""
    return ((h & _M16) * c + (((h >> 16) * (c & _M16)) << 16)) & _M32


def _fmix32(h):
    """MurmurHash3's 32-bit finalizer (a bijection of [0, 2**32))."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform_values(seed: int, name: str, start: int, count: int, device="cpu"):
    """Elements ``start .. start + count`` of tensor ``name`` (flattened), float32."""
    import torch

    k0, k1 = tensor_key(seed, name)
    half_width = INIT_STD * math.sqrt(3.0)
    out = torch.empty(count, dtype=torch.float32, device=device)
    chunk = CHUNK if out.device.type != "cpu" else min(CHUNK, CPU_CHUNK)  # CHUNK bounds both (tests lower it)
    for lo in range(0, count, chunk):
        n = min(chunk, count - lo)
        i = torch.arange(start + lo, start + lo + n, dtype=torch.int64, device=device)
        h = _fmix32((i & _M32) ^ k0)
        h = _fmix32(h ^ (((i >> 32) + k1) & _M32))
        odd = (h >> 8) * 2 - ((1 << 24) - 1)  # odd integers in [-(2**24 - 1), 2**24 - 1], mean 0
        out[lo:lo + n] = (odd.to(torch.float64) * (half_width / 2**24)).to(torch.float32)
    return out


def is_norm(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 1 and "norm" in name


def full_tensor(seed: int, name: str, shape: tuple[int, ...], device="cpu"):
    """The whole checkpoint tensor ``name`` (float32)."""
    import torch

    if is_norm(name, shape):
        return torch.ones(shape, dtype=torch.float32, device=device)
    return uniform_values(seed, name, 0, math.prod(shape), device).reshape(shape)


def checkpoint_specs(folder: Path | str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the folder's HF checkpoint, from its config alone (tied weights once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def checkpoint(folder: Path | str, seed: int, device="cpu") -> Iterator[tuple[str, object]]:
    """(name, full float32 tensor) pairs, one tensor alive at a time."""
    for name, shape in checkpoint_specs(folder):
        yield name, full_tensor(seed, name, shape, device)


def embedding_rows(folder: Path | str, seed: int, token_ids) -> np.ndarray:
    """Rows of the input embedding (float32), drawn alone."""
    specs = dict(checkpoint_specs(folder))
    name = next((n for n in specs if n.endswith("embed_tokens.weight")), None)
    if name is None:
        raise ValueError(f"no embed_tokens.weight among the checkpoint tensors of {folder}")
    width = specs[name][1]
    return np.stack([uniform_values(seed, name, int(i) * width, width).numpy() for i in token_ids])


def write_config_folder(out: Path, config: dict, tokenizer_dir: Path, tokenizer_files) -> Path:
    """A model folder for seeded weights: config.json (bfloat16 Llama), generation_config.json and the tokenizer
    files of ``tokenizer_dir``, whose ids must all be below the config's vocab_size. Written into a temporary
    folder and renamed into place; an existing complete folder is kept."""
    from transformers import AutoTokenizer

    if (out / "COMPLETE").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if len(tokenizer) > config["vocab_size"]:
        raise ValueError(f"tokenizer of {tokenizer_dir} has {len(tokenizer)} ids, over vocab_size "
                         f"{config['vocab_size']}")
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    full = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16", "use_cache": True,
            **config, **ids}
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dump = lambda obj: json.dumps(obj, indent=2, sort_keys=True) + "\n"  # noqa: E731
    (tmp / "config.json").write_text(dump(full))
    (tmp / "generation_config.json").write_text(dump(ids))
    for f in tokenizer_files:
        if (tokenizer_dir / f).exists():
            shutil.copy2(tokenizer_dir / f, tmp / f)
    (tmp / "COMPLETE").write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)  # an unfinished folder of an earlier attempt
    tmp.rename(out)
    return out


def llama70b_folder(out: Path, num_layers: int = LLAMA3_70B["num_hidden_layers"]) -> Path:
    """Llama-3-70B's shape (``num_layers`` of its layers) with SmolLM2's tokenizer (49,152 ids inside the
    128,256-row vocabulary), for seeded weights."""
    from interp_runner.models.materialize import TOKENIZER_FILES, model_path

    return write_config_folder(out, {**LLAMA3_70B, "num_hidden_layers": num_layers}, model_path("smollm2_135m"),
                               TOKENIZER_FILES)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Write a Llama-3-70B-shaped model folder for seeded weights.")
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=LLAMA3_70B["num_hidden_layers"])
    args = ap.parse_args()
    print(llama70b_folder(args.out, args.layers))
