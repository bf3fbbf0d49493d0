"""The ``serve:`` section of an ``interp-serve`` config and the ``interp`` object of a request, as pydantic models
in the config schema's strict style (unknown keys refused, nothing converted, floats finite)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError

from interp_runner.config.errors import ConfigError, problems_of
from interp_runner.config.schema import CaptureHook, LayerSelector, SteeredHook, Strict, Tiers

MiB = 1 << 20


class SiteSet(Strict):
    hooks: Annotated[list[SteeredHook], Field(min_length=1)] = ["post_block"]
    layers: LayerSelector = "all"


class CaptureSiteSet(SiteSet):
    hooks: Annotated[list[CaptureHook], Field(min_length=1)] = ["post_block"]  # router_logits too, on a MoE model


class Sites(Strict):
    """Every site a request may steer or capture at: fixed when the engine starts (its compiled graphs and CUDA
    graphs hold the ops of these sites and no others). ``steering.global`` sites are added to ``steer``."""

    steer: SiteSet = SiteSet()
    capture: CaptureSiteSet = CaptureSiteSet()


class ServeSettings(Strict):
    sites: Sites = Sites()
    # folders a vector upload may name a file in (``{"file": "x.npy"}``, relative to one of them); none: no files
    vector_dirs: list[str] = []
    args: list[str] = []  # vLLM's own server flags (``--host``, ``--port``, ``--api-key``, ...)
    max_body_bytes: int = Field(16 * MiB, ge=1024)  # a completion or chat request's body
    max_upload_bytes: int = Field(64 * MiB, ge=1024)  # a vector upload's body
    max_capture_bytes: int = Field(64 * MiB, ge=1024)  # a response's captured values, at most
    max_vectors: int = Field(1024, ge=1)  # named vectors held at once
    max_inline_values: int = Field(1 << 16, ge=1)  # floats of one inline vector


class CaptureRequest(Strict):
    # router_logits (a MoE model's): rows of one logit per expert, not the hidden size
    hooks: Annotated[list[CaptureHook], Field(min_length=1)] = ["post_block"]
    layers: LayerSelector
    positions: Literal["last_prompt", "all_generated"] = "last_prompt"
    dtype: Literal["float16", "float32"] = "float16"


class InterpRequest(Strict):
    """A request's ``interp`` object."""

    steering: Tiers = Tiers()
    capture: CaptureRequest | None = None
    answer: str | None = Field(None, min_length=1)  # scored: exact log-probability after the prompt
    foil: str | None = Field(None, min_length=1)


def validate_serve(data: object) -> ServeSettings:
    try:
        return ServeSettings.model_validate(data if data is not None else {})
    except ValidationError as err:
        raise ConfigError(problems_of(err, "serve")) from None


def validate_interp(data: object) -> InterpRequest:
    try:
        spec = InterpRequest.model_validate(data)
    except ValidationError as err:
        raise ConfigError(problems_of(err, "interp")) from None
    if spec.foil is not None and spec.answer is None:
        raise ConfigError.at("interp.foil", "a foil needs an answer")
    return spec


@dataclass
class Prepared:
    """Everything the server needs, checked before the engine starts."""

    vllm_args: list[str]
    settings: ServeSettings
    served: object  # compile.Served
    folder: Path
    named: dict
    global_steer: list
    global_vectors: dict
    ignored: list[str]
    tokenizer: object = None  # ``tokens.TextTokenizer`` (answers' ids)
    plugin: str = ""  # the fingerprint of the plugin code the engine is started with
    model_runner: str = "auto"  # engine.model_runner: vLLM's model runner, as interp-run picks it
