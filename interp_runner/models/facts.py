"""What the compiler needs to know about a model, read from its folder without starting an engine."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from interp_runner.models import seeded
from interp_runner.models.layouts import UnsupportedArchitecture, layout_for

# config.json keys vLLM reads a model's longest sequence from (the smallest of those present counts)
MAX_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                   "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")


class UnsupportedModel(ValueError):
    pass


@dataclass(frozen=True)
class Routing:
    """How a MoE block chooses its experts: softmax over ``num_experts`` router logits, the top ``top_k`` kept,
    their weights renormalized to sum to 1 where ``renormalize`` (``BlockLayout.router_config``)."""

    num_experts: int
    top_k: int
    renormalize: bool
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is dense (no router): Qwen3-MoE's ``mlp_only_layers``
    # and those off ``decoder_sparse_step``


@dataclass(frozen=True)
class ModelFacts:
    path: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    weights_sha256: str
    # what vLLM's own checks need (``interp_runner.engine.rules``)
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    dtype: str = "float32"  # of the weights in config.json
    max_model_len: int | None = None  # the longest sequence vLLM allows (None: the config does not say)
    max_model_len_key: str = ""  # where that comes from
    routing: Routing | None = None  # a MoE family's (``BlockLayout.router``); None: dense blocks

    @classmethod
    def from_folder(cls, folder: Path, weights_seed: int | None = None) -> ModelFacts:
        """With ``weights_seed``, the weights are seeded ones (``seeded``), not the folder's files."""
        config = read_json(folder / "config.json")
        architecture = (config.get("architectures") or ["<none>"])[0]
        try:
            layout = layout_for(architecture)
        except UnsupportedArchitecture as err:
            raise UnsupportedModel(str(err)) from None
        if weights_seed is None and not any(folder.glob("*.safetensors")):
            raise UnsupportedModel(f"{folder} holds no .safetensors weights")
        text = config.get("text_config", config)
        # the family's own names for the standard keys (GPT-2's n_layer, ...), where the standard one is absent
        text = {**{std: text[own] for std, own in layout.config_aliases if text.get(own) is not None}, **text}
        for key, value in layout.config_requires:
            if text.get(key) != value:
                raise UnsupportedModel(f"{folder / 'config.json'}: {key} is {text.get(key)!r}; {layout.family} "
                                       f"blocks are supported with {key} {value!r} only")

        def count(key: str, default: int | None = None) -> int:
            value = text.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UnsupportedModel(f"{folder / 'config.json'}: {key} is {value!r}, not a positive int")
            return value

        routing = None
        if layout.router is not None:
            experts_key, top_k_key, renormalize_key = layout.router_config
            renormalize = text.get(renormalize_key, False)
            if not isinstance(renormalize, bool):
                raise UnsupportedModel(f"{folder / 'config.json'}: {renormalize_key} is {renormalize!r}, not a bool")
            step, only = text.get("decoder_sparse_step", 1) or 1, text.get("mlp_only_layers") or []
            dense = tuple(layer for layer in range(count("num_hidden_layers"))
                          if layer in only or (layer + 1) % step != 0)
            routing = Routing(count(experts_key), count(top_k_key), renormalize, dense)
            if routing.top_k > routing.num_experts:
                raise UnsupportedModel(f"{folder / 'config.json'}: {top_k_key} {routing.top_k} is more than "
                                       f"{experts_key} {routing.num_experts}")
        num_heads = count("num_attention_heads")
        hidden_size = count("hidden_size")
        tokenizer_config = folder / "tokenizer_config.json"
        max_len, max_len_key = max_model_len(text, read_json(tokenizer_config) if tokenizer_config.is_file() else {})
        return cls(
            path=str(folder),
            architecture=architecture,
            num_layers=count("num_hidden_layers"),
            hidden_size=hidden_size,
            vocab_size=count("vocab_size"),
            weights_sha256=weights_sha256(folder) if weights_seed is None else seeded.weights_id(weights_seed),
            num_heads=num_heads,
            num_kv_heads=count("num_key_value_heads", num_heads),
            head_dim=count("head_dim") if text.get("head_dim") is not None else hidden_size // num_heads,
            # absent (GPT-2's n_inner null): GPT-2's and GPT-NeoX's 4 x hidden_size
            intermediate_size=count("intermediate_size", 4 * hidden_size),
            dtype=str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "float32"),
            max_model_len=max_len,
            max_model_len_key=max_len_key,
            routing=routing,
        )


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UnsupportedModel(f"cannot read {path}: {err}") from None
    if not isinstance(data, dict):
        raise UnsupportedModel(f"{path} is not a JSON object")
    return data


def max_model_len(config: dict, tokenizer_config: dict) -> tuple[int | None, str]:
    """The longest sequence vLLM 0.26 allows the model (``_get_and_verify_max_len``): the smallest length key of
    the config (``model_max_length`` wins where given), at most the tokenizer's ``model_max_length``, times the
    RoPE scaling factor."""
    found = {k: config[k] for k in MAX_LENGTH_KEYS if isinstance(config.get(k), (int, float))}
    if not found:
        return None, ""
    key = "model_max_length" if "model_max_length" in found else min(found, key=found.get)
    length = found[key]
    tokenizer_max = tokenizer_config.get("model_max_length")
    if isinstance(tokenizer_max, (int, float)) and tokenizer_max < length:
        key, length = "model_max_length (tokenizer_config.json)", tokenizer_max
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if isinstance(rope, dict):
        per_layer_type = rope.values() if all(isinstance(v, dict) for v in rope.values()) else [rope]
        factor = 1.0
        for params in per_layer_type:
            kind = params.get("rope_type", params.get("type"))
            if kind not in ("su", "longrope", "llama3"):
                factor = params.get("factor") or factor
                if kind == "yarn" and "original_max_position_embeddings" in params:
                    length = params["original_max_position_embeddings"]
        if factor != 1.0:
            key = f"{key} x rope factor {factor}"
        length *= factor
    return (int(length) if math.isfinite(length) else None), key


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
    """Rows of the input embedding matrix (float32), read straight from the safetensors files, as layer 0 reads
    them (times the family's ``BlockLayout.embed_scale``)."""
    from safetensors import safe_open

    ids = np.asarray(token_ids, dtype=np.int64)
    config = read_json(Path(folder) / "config.json")
    layout = layout_for((config.get("architectures") or ["<none>"])[0])
    text = config.get("text_config", config)
    scale = np.float32(text["hidden_size"] ** 0.5) if layout.embed_scale == "sqrt_hidden" else None
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            name = next((k for k in fh.keys() if k.endswith(layout.embed_tensor)), None)
            if name is not None:
                table = fh.get_slice(name)
                rows = np.stack([table[int(i) : int(i) + 1].float().numpy()[0] for i in ids])
                return rows if scale is None else rows * scale
    raise UnsupportedModel(f"no {layout.embed_tensor} in {folder}")
