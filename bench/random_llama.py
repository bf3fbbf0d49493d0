"""A random-weight Llama of a given shape as an HF folder, for the benches (the 8B and 70B shapes)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

LLAMA8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256)
SHAPE_KEYS = tuple(LLAMA8B)  # the order of a shape given as comma-separated numbers (``--llama-shape``)


def llama_shape(text: str) -> dict:
    """``LLAMA8B``, or the shape ``text`` gives as ``SHAPE_KEYS`` in order (hidden,layers,heads,kv_heads,
    intermediate,vocab)."""
    return dict(zip(SHAPE_KEYS, (int(x) for x in text.split(",")))) if text else dict(LLAMA8B)


def random_llama(out: Path, shape: dict, weights: str, device: str) -> Path:
    """An HF folder with a Llama of ``shape``: config + SmolLM2's tokenizer, and either no weights (vLLM's
    dummy loader draws them: ``weights='dummy'``) or random bf16 safetensors from transformers."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from interp_runner.models.materialize import TOKENIZER_FILES, model_path

    if (out / "COMPLETE").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        smol = model_path("smollm2_135m")
        tokenizer = AutoTokenizer.from_pretrained(smol)
    except Exception as err:  # the tokenizer alone, straight from the GGUF
        from interp_runner.models.materialize import _gguf_path

        print(f"SmolLM2 folder unavailable ({err}); tokenizer from the GGUF", flush=True)
        gguf = _gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        smol = out / ".tokenizer"
        tokenizer.save_pretrained(smol)
    config = LlamaConfig(
        **shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"], max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="bfloat16", architectures=["LlamaForCausalLM"],
    )
    if weights == "hf":
        t0 = time.perf_counter()
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                model = LlamaForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(default)
        model.save_pretrained(out, safe_serialization=True)
        del model
        print(f"random Llama weights written in {time.perf_counter() - t0:.1f} s", flush=True)
    else:
        config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (smol / f).exists():
            shutil.copy2(smol / f, out / f)
    (out / "weights.sha256").write_text(f"random-{weights}\n")  # nothing worth hashing
    (out / "COMPLETE").write_text("ok\n")
    return out
