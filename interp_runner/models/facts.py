"""What the compiler needs to know about a model, read from its folder without starting an engine."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .architectures import DECODER_LAYERS


class UnsupportedModel(ValueError):
    pass


@dataclass(frozen=True)
class ModelFacts:
    path: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    weights_sha256: str

    @classmethod
    def from_folder(cls, folder: Path) -> ModelFacts:
        config = json.loads((folder / "config.json").read_text())
        architecture = (config.get("architectures") or ["<none>"])[0]
        if architecture not in DECODER_LAYERS:
            raise UnsupportedModel(
                f"unsupported architecture {architecture}; supported: {', '.join(DECODER_LAYERS)}"
            )
        text = config.get("text_config", config)
        return cls(
            path=str(folder),
            architecture=architecture,
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            vocab_size=int(text["vocab_size"]),
            weights_sha256=weights_sha256(folder),
        )


def weights_sha256(folder: Path) -> str:
    """sha256 over the folder's safetensors files (cached in ``weights.sha256`` when the folder has one)."""
    recorded = folder / "weights.sha256"
    if recorded.exists():
        return recorded.read_text().split()[0]
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def embedding_rows(folder: Path, token_ids) -> np.ndarray:
    """Rows of the input embedding matrix (float32), read straight from the safetensors files."""
    from safetensors import safe_open

    ids = np.asarray(token_ids, dtype=np.int64)
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            name = next((k for k in fh.keys() if k.endswith("embed_tokens.weight")), None)
            if name is not None:
                table = fh.get_slice(name)
                return np.stack([table[int(i) : int(i) + 1].float().numpy()[0] for i in ids])
    raise UnsupportedModel(f"no embed_tokens.weight in {folder}")
