"""The run configuration as the user writes it (after Hydra composition), validated by pydantic.

Checks that need the model (layer ranges, hidden size, prompt lengths) live in the experiment kinds' ``compile``;
everything here is about the shape of the config itself. All models are frozen, refuse unknown keys and convert
nothing: a "3" is no int, a 1.5 no int, a true no number. Every float must be finite, and those the engine computes
with must stay finite (and, where they must be positive, nonzero) as float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import numpy as np
from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, ValidationInfo, create_model,
    field_validator, model_validator,
)

from interp_runner.sites import CAPTURE_HOOKS, CAPTURE_ONLY_HOOKS, HOOKS, RESIDUAL_HOOKS, capture_only_refusal

Hook = Literal[HOOKS]
CaptureHook = Literal[CAPTURE_HOOKS]  # the hooks plus the capture-only ones (``sites.CAPTURE_ONLY_HOOKS``)
ResidualHook = Literal[tuple(h for h in HOOKS if h in RESIDUAL_HOOKS)]


def _not_capture_only(act: str):
    def check(value: Any) -> Any:
        if isinstance(value, str) and value in CAPTURE_ONLY_HOOKS:
            raise ValueError(capture_only_refusal(value, act))
        return value
    return check


# a capture-only hook refused by name where a run acts
SteeredHook = Annotated[Hook, BeforeValidator(_not_capture_only("steered"))]
PatchedHook = Annotated[Hook, BeforeValidator(_not_capture_only("patched"))]
# a layer selector: 3, [1, 5], "all", "2:6" (half-open range)
IndexList = Annotated[list[StrictInt], Field(min_length=1)]
LayerSelector = Union[StrictInt, IndexList, str]
# a prompt selector: 0, [0, 2], "all"
PromptSelector = Union[StrictInt, IndexList, Literal["all"]]
VECTOR_SUFFIXES = (".npy", ".safetensors", ".pt", ".pth", ".gguf")
STRICT = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def distinct(values: list, info: ValidationInfo) -> list:
    if len(values) != len(set(values)):
        raise ValueError(f"{info.field_name} repeat: {values}")
    return values


def _finite_float32(value: float) -> float:
    with np.errstate(over="ignore"):
        if not np.isfinite(np.float32(value)):
            raise ValueError(f"{value} is beyond float32's range (about ±3.4e38): the engine computes in float32")
    return value


def _nonzero_float32(value: float) -> float:
    if value != 0 and np.float32(value) == 0:
        raise ValueError(f"{value} rounds to 0 as float32, the precision the engine computes in")
    return value


Float32 = Annotated[float, AfterValidator(_finite_float32), AfterValidator(_nonzero_float32)]
PositiveFloat32 = Annotated[float, Field(gt=0), AfterValidator(_finite_float32), AfterValidator(_nonzero_float32)]
# numpy's and vLLM's generators take seeds in [0, 2**32) (vLLM reads a request seed of -1 as "unseeded")
Seed = Annotated[int, Field(ge=0, lt=2**32)]


class Strict(BaseModel):
    model_config = STRICT


class RandomDirection(Strict):
    seed: Seed = 0
    norm: PositiveFloat32 = 1.0


DEFAULT_STORE_METHOD = "mean_diff"


class VectorSpec(Strict):
    """Exactly one source: inline values, a file (.npy/.safetensors/.pt, ``key`` picks a tensor; a llama.cpp
    control vector .gguf, ``layer`` picks its ``direction.<layer>``), a named vector declared under ``vectors:``,
    a seeded random direction, or a vector a ``steering_vectors`` run derived (``store`` with ``hook``, ``layer``
    and ``method``, default mean_diff)."""

    values: list[Float32] | None = None
    file: str | None = None
    key: str | None = None
    name: str | None = None
    random: RandomDirection | None = None
    store: str | None = Field(None, min_length=1)
    method: str | None = Field(None, min_length=1)
    hook: Hook | None = None
    layer: int | None = Field(None, ge=0)  # 0-based decoder layer

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, (list, tuple)):
            return {"values": list(data)}
        if isinstance(data, str):
            return {"file": data} if data.endswith(VECTOR_SUFFIXES) else {"name": data}
        return data

    @model_validator(mode="after")
    def _one_source(self) -> VectorSpec:
        given = [f for f in ("values", "file", "name", "random", "store") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of values, file, name, random, store (got {given or 'none'})")
        gguf = self.file is not None and self.file.endswith(".gguf")
        if self.key is not None and (self.file is None or self.file.endswith((".npy", ".gguf"))):
            raise ValueError("'key' only applies to a .safetensors or .pt file")
        if self.file is not None and not self.file.endswith(VECTOR_SUFFIXES):
            raise ValueError(f"{self.file!r}: a vector file is one of {', '.join(VECTOR_SUFFIXES)}")
        if self.store is None and (self.hook is not None or self.method is not None):
            raise ValueError("'hook' and 'method' only apply to a 'store'")
        if self.layer is not None and self.store is None and not gguf:
            raise ValueError("'layer' only applies to a 'store' or a .gguf control vector file")
        if self.store is not None and (self.hook is None or self.layer is None):
            raise ValueError("a 'store' vector needs 'hook' and 'layer' (and 'method', default mean_diff)")
        if gguf and self.layer is None:
            raise ValueError(f"{self.file!r}: say which of its direction.N with 'layer' (the decoder layer N whose "
                             "output llama.cpp adds it to)")
        return self


class SteerTerm(Strict):
    layer: LayerSelector
    vector: VectorSpec
    scale: Float32 = 1.0


Terms = Union[SteerTerm, list[SteerTerm]]


class _TierTerms(Strict):
    @field_validator(*CAPTURE_ONLY_HOOKS, mode="before", check_fields=False)
    @classmethod
    def _capture_only(cls, value: Any, info: ValidationInfo) -> Any:
        raise ValueError(capture_only_refusal(info.field_name, "steered"))

    def terms(self) -> list[tuple[str, int | None, SteerTerm]]:
        """(hook, index within the hook's list or None, term) in hook order."""
        out = []
        for hook in HOOKS:
            value = getattr(self, hook)
            if isinstance(value, SteerTerm):
                out.append((hook, None, value))
            elif value is not None:
                out.extend((hook, i, t) for i, t in enumerate(value))
        return out


# steering terms per hook point: one optional key per hook (a capture-only hook's key is refused by name)
Tier = create_model("Tier", __base__=_TierTerms, **{hook: (Optional[Terms], None) for hook in HOOKS},
                    **{hook: (Any, None) for hook in CAPTURE_ONLY_HOOKS})


class Tiers(Strict):
    base: Tier = Tier()
    prefill: Tier = Tier()
    decode: Tier = Tier()


class RequestSteering(Tiers):
    prompts: PromptSelector


class Steering(Strict):
    model_config = ConfigDict(**STRICT, populate_by_name=True)

    global_: Tiers = Field(Tiers(), alias="global")
    request: list[RequestSteering] = []


CapturePositions = Union[Literal["last_prompt", "all_prompt", "all_generated", "all"], IndexList]


class CaptureSpec(Strict):
    """Values at ``hooks`` x ``layers`` x ``positions``. A capture-only hook (``router_logits``: one logit per
    expert, not hidden-size rows) is captured in an entry of its own."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z0-9_]*$")] = "acts"
    hooks: Annotated[list[CaptureHook], Field(min_length=1), AfterValidator(distinct)]
    layers: LayerSelector = "all"
    positions: CapturePositions = "last_prompt"
    prompts: PromptSelector = "all"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"

    @field_validator("hooks")
    @classmethod
    def _capture_only_alone(cls, hooks: list[str]) -> list[str]:
        alone = [h for h in hooks if h in CAPTURE_ONLY_HOOKS]
        if alone and len(hooks) > 1:
            raise ValueError(f"{alone[0]!r} is captured in a capture entry of its own (its rows hold one value "
                             f"per expert, not the hidden size): give it an entry with hooks: [{alone[0]}]")
        return hooks


class PromptItem(Strict):
    text: str = Field(min_length=1)
    id: str | None = Field(None, min_length=1)
    answer: str | None = None  # scored: its exact log-probability after the prompt
    foil: str | None = None  # scored beside the answer (logit difference)

    @model_validator(mode="after")
    def _foil_needs_answer(self) -> PromptItem:
        if self.foil is not None and self.answer is None:
            raise ValueError("'foil' needs an 'answer'")
        return self


class PromptRow(PromptItem):
    """A line of a prompt file: a prompt item whose text may be given as ``prompt``; other keys are metadata."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _prompt_is_text(cls, data: Any) -> Any:
        if isinstance(data, dict) and "prompt" in data:
            if "text" in data:
                raise ValueError("give 'text' or 'prompt', not both")
            data = {("text" if k == "prompt" else k): v for k, v in data.items()}
        return data


class Prompts(Strict):
    items: list[Union[Annotated[str, Field(min_length=1)], PromptItem]] = []
    file: str | None = None  # JSONL, one {"text": ..., "id": ...} (or {"prompt": ...}) a line
    chat_template: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> Prompts:
        if self.items and self.file:
            raise ValueError("give either 'items' or 'file', not both")
        return self


class Span(Strict):
    """The tokens of a substring of the prompt (its ``occurrence``-th appearance, from 0)."""

    span: str = Field(min_length=1)
    occurrence: int = Field(0, ge=0)


class PatchSource(Strict):
    """Exactly one: the captured run of another prompt, a vector, or zeros."""

    prompt: StrictInt | None = Field(None, ge=0)
    vector: VectorSpec | None = None
    zeros: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> PatchSource:
        given = [f for f in ("prompt", "vector") if getattr(self, f) is not None] + (["zeros"] if self.zeros else [])
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, vector, zeros (got {given or 'none'})")
        return self


class PatchSpec(Strict):
    """value <- (1 - alpha) * value + alpha * source at (hook, layers, positions) of the destination prompts."""

    prompts: PromptSelector
    source: PatchSource
    hook: PatchedHook
    layers: LayerSelector
    positions: Union[Literal["all"], IndexList, Span] = "all"
    alpha: float = Field(1.0, ge=0, le=1)


class Scoring(Strict):
    first_token: bool = False  # score the first token of a multi-token answer instead of refusing it


class Sampling(Strict):
    """vLLM's own ranges (``SamplingParams._verify_args``; ``ModelConfig.max_logprobs`` defaults to 20)."""

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0, le=2)
    top_p: Annotated[float, Field(gt=0, le=1), AfterValidator(_nonzero_float32)] = 1.0
    seed: Seed = 0  # prompt i is sampled with seed + i
    logprobs: int | None = Field(None, ge=0, le=20)
    # a store whose requests' generated tokens each request of this run generates instead (same request ids and
    # prompts): log-probabilities, top-k and captures are then this run's for those tokens
    teacher_forcing: str | None = None


CPU_PACKED_BLOCK_SIZE = 32


class EngineConfig(Strict):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # null: torch.compile + CUDA graphs on a GPU for plans that generate text, eager otherwise (``resolved``)
    enforce_eager: bool | None = None
    # null: the model's own maximum, as `vllm serve` takes it (interp-serve's default)
    max_model_len: int | None = Field(2048, ge=16)
    # null: vLLM's default for the machine, as `vllm serve` takes it (interp-serve's default; 1024 on an 80 GB GPU,
    # 256 elsewhere), which also sets the largest CUDA graph: twice this, up to 512 tokens
    max_num_seqs: int | None = Field(64, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    enable_prefix_caching: bool = True
    patch_bank_rows: int | None = Field(None, ge=1)  # default: what the plan needs
    seed: Seed = 0
    # vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1): a request's numbers no longer depend on what it
    # was batched with, so GPU reruns reproduce bit for bit (slower; GPU only)
    batch_invariant: bool = False
    # vLLM's KV-cache block size in tokens; null: vLLM's (16 on a GPU, 128 on a CPU), but 32 on a CPU that packs
    # cells, each padded to a whole block (``resolved``)
    block_size: int | None = Field(None, ge=16, multiple_of=16)
    # causal-trace cells that share a prompt prefix run packed into shared engine requests (``packing``), each
    # skipping the layers below its lowest restore; null: on
    pack_cells: bool | None = None
    # packed cells enter the model at a multiple of this many layers (their lowest restore rounded down): fewer
    # distinct entry layers mean less host work per step (attention metadata, kept streams) for a few more layers
    # computed
    cell_entry_stride: int = Field(4, ge=1)
    # vLLM's model runner: auto (the one vLLM picks: V2 for dense models where Triton runs, else V1), v1 or v2
    # (docs/model_runners.md); the store records the one that ran (engine.model_runner)
    model_runner: Literal["auto", "v1", "v2"] = "auto"

    def eager(self, gpu: bool, decodes: bool = True) -> bool:
        """``enforce_eager``, or where the config leaves it open: eager on a CPU, and on a GPU for a plan whose
        requests each generate one token (a causal trace: its cells run layer by layer anyway), where compiling
        and capturing graphs costs more than it saves (bench/RESULTS.md, "Engine start and whole runs")."""
        return not (gpu and decodes) if self.enforce_eager is None else self.enforce_eager

    def resolved(self, gpu: bool, decodes: bool) -> EngineConfig:
        """This config with ``enforce_eager`` (``eager``) and ``block_size`` (``kv_block_size``) decided for a plan
        that does or does not ``decode``: on a CPU that packs cells, 32-token blocks, as vLLM's CPU default of 128
        would pad each cell's few tokens to 128 and its CPU attention prefers multiples of 32 (bench/RESULTS.md,
        "CPU measurements")."""
        return self.model_copy(update={"enforce_eager": self.eager(gpu, decodes), "block_size": self.kv_block_size(gpu)})

    def kv_block_size(self, gpu: bool) -> int | None:
        """``block_size``, or where the config leaves it open: 32 on a CPU that packs cells, else None (vLLM's)."""
        if self.block_size is None and not gpu and self.packs_cells():
            return CPU_PACKED_BLOCK_SIZE
        return self.block_size

    def packs_cells(self) -> bool:
        return True if self.pack_cells is None else self.pack_cells


class ModelConfig(Strict):
    name: str
    path: str | None = None  # a local HF folder; otherwise ``name`` is a built-in model
    # "seeded": no weight files; every tensor drawn from ``seed`` and its name, the same at any tensor-parallel
    # size (``interp_runner.models.seeded``): a folder with config.json and tokenizer files suffices
    weights: Literal["files", "seeded"] = "files"
    seed: Seed = 0

    @field_validator("seed")
    @classmethod
    def _seed_needs_seeded(cls, seed: int, info: ValidationInfo) -> int:
        if info.data.get("weights") != "seeded":
            raise ValueError("'seed' only applies to weights: seeded")
        return seed

    def weights_seed(self) -> int | None:
        """The seed of seeded weights; None for weights read from the folder's files."""
        return self.seed if self.weights == "seeded" else None


class StoreConfig(Strict):
    path: str | None = None  # default: <run dir>/results.zarr
    # requests per unit of work, journaled as it finishes (resume); null: at most MAX_UNITS units a stage, each of
    # at least MIN_UNIT requests (a unit ends with a drained batch and an emptied prefix cache)
    unit_requests: int | None = Field(None, ge=1)
    overwrite: bool = False  # replace an existing store at path (and its companions) once the new one is complete


class ExperimentMeta(Strict):
    name: str = "adhoc"
    version: int = 1
    description: str = ""


class RunBase(Strict):
    """The keys of every run config: the prompts kind's (prompts, steering, capture, patching, ...) and the run's own.
    The run config (``interp_runner.config.run.RunConfig``) adds one optional section per registered experiment
    kind (``interp_runner.kinds``)."""

    experiment: ExperimentMeta = ExperimentMeta()
    model: ModelConfig
    engine: EngineConfig = EngineConfig()
    prompts: Prompts
    sampling: Sampling = Sampling()
    vectors: dict[str, VectorSpec] = {}
    steering: Steering = Steering()
    capture: list[CaptureSpec] = []
    patching: list[PatchSpec] = []
    scoring: Scoring = Scoring()
    store: StoreConfig = StoreConfig()
    dry_run: bool = False
    resume: bool = False  # continue the unfinished store at store.path: run only the units it lacks

    @field_validator("capture")
    @classmethod
    def _unique_capture_names(cls, capture: list[CaptureSpec]) -> list[CaptureSpec]:
        names = [c.name for c in capture]
        if len(names) != len(set(names)):
            raise ValueError(f"capture entries need distinct names (got {names})")
        return capture


def resolve_path(path: str, base: Path | None = None) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() or base is None else base / p
