"""``interp-serve``: compose the same Hydra config as ``interp-run`` (``conf/serve.yaml``: ``config.yaml`` plus the
``serve:`` section), validate it before any engine starts (exit 2 naming the key), then run vLLM's OpenAI server with
the interp plugin (``server``). vLLM's own server flags come from ``serve.args`` and after ``--``.

The config's ``model``, ``engine``, ``vectors`` (registered as named vectors) and ``steering.global`` (applied to every
request) are used; what is per prompt (``prompts``, ``steering.request``, ``capture``, ...) is said and left out:
requests carry their own in their ``interp`` object.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from interp_runner.cli import CONF_DIR, report, resolved
from interp_runner.cli_errors import COMMAND_LINE_ERRORS, explain
from interp_runner.config.errors import EXIT_CODE, ConfigError
from interp_runner.serve.settings import Prepared

CONFIG_NAME = "serve"
USED_KEYS = ("model", "engine", "vectors", "steering.global")
WORKER_EXTENSION = "interp_runner.plugin.runtime.InterpWorkerExtension"
CPU_KV_CACHE_BYTES = 1 << 30


def compose(overrides: list[str]) -> dict:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name=CONFIG_NAME, overrides=overrides)
    return resolved(cfg)


def _ignored(cfg) -> list[str]:
    keys = [key for key, set_ in (("prompts", bool(cfg.prompts.items or cfg.prompts.file)),
                                  ("steering.request", bool(cfg.steering.request)), ("capture", bool(cfg.capture)),
                                  ("patching", bool(cfg.patching)))
            if set_]
    return keys + [kind.section for kind in _sections() if getattr(cfg, kind.section, None) is not None]


def _sections():
    from interp_runner.config.run import SECTIONS

    return SECTIONS


def engine_flags(cfg, facts, gpu: bool) -> list[str]:
    e = cfg.engine
    flags = ["--dtype", e.dtype, "--tensor-parallel-size", str(e.tensor_parallel_size), "--seed", str(e.seed),
             "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
             "--served-model-name", cfg.model.name]
    if e.eager(gpu):
        flags.append("--enforce-eager")
    if e.max_model_len is not None:  # else the model's own, as `vllm serve` takes it
        flags += ["--max-model-len", str(e.max_model_len)]
    if e.max_num_seqs is not None:  # else vLLM's default for this machine
        flags += ["--max-num-seqs", str(e.max_num_seqs)]
    if e.max_num_batched_tokens is not None:
        flags += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    if e.block_size is not None:
        flags += ["--block-size", str(e.block_size)]
    if e.kv_cache_memory_bytes is not None or not gpu:
        flags += ["--kv-cache-memory-bytes", str(e.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES)]
    if gpu:  # with a fixed KV cache too: vLLM's start checks the free memory against it
        flags += ["--gpu-memory-utilization", str(e.gpu_memory_utilization)]
    seed = cfg.model.weights_seed()
    if seed is not None:
        from interp_runner.models.seeded import LOAD_FORMAT

        flags += ["--load-format", LOAD_FORMAT, "--model-loader-extra-config", json.dumps({"seed": seed})]
    return flags


def prepare(config: dict, extra_args: list[str]) -> Prepared:
    """Validate the composed config; every problem is a ``ConfigError`` naming its key."""
    from interp_runner.engine.settings import on_gpu
    from interp_runner.engine.rules import check_engine, model_dtype
    from interp_runner.models.facts import ModelFacts, UnsupportedModel
    from interp_runner.models.materialize import model_folder
    from interp_runner.payload import EngineSpec
    from interp_runner.config.run import validate_config
    from interp_runner.compile.steering import load_named_vectors
    from interp_runner.compile.tokens import TextTokenizer, TokenizerError
    from interp_runner.serve.compile import Served, check_dtype, site_set, steer_entries
    from interp_runner.serve.settings import validate_serve

    config = dict(config)
    settings = validate_serve(config.pop("serve", None))
    cfg = validate_config(config)
    folder = model_folder(cfg.model)
    gpu = on_gpu()
    try:
        facts = ModelFacts.from_folder(folder, cfg.model.weights_seed())
        tokenizer = TextTokenizer(folder)
    except (UnsupportedModel, TokenizerError) as err:
        raise ConfigError.at("model.path" if cfg.model.path else "model.name", str(err)) from None
    check_engine(cfg, facts, gpu)
    for i, folder_name in enumerate(settings.vector_dirs):
        if not Path(folder_name).is_dir():
            raise ConfigError.at(f"serve.vector_dirs[{i}]", f"{folder_name} is not a folder")
    named = load_named_vectors(cfg, facts, None)
    global_vectors, global_steer = steer_entries(cfg.steering.global_, "steering.global", facts, named)
    dtype = model_dtype(cfg, facts)
    check_dtype(global_steer, global_vectors, dtype, "engine.dtype")
    steer_sites = site_set(settings.sites.steer, facts, "serve.sites.steer") | {e.site for e in global_steer}
    capture_sites = site_set(settings.sites.capture, facts, "serve.sites.capture")
    served = Served(facts, dtype, frozenset(steer_sites), frozenset(capture_sites))
    spec = EngineSpec(tuple(sorted(steer_sites)), tuple(sorted(capture_sites)))
    additional = spec.as_additional_config(results_with_outputs=True)
    args = ["--model", str(folder), *engine_flags(cfg, facts, gpu), "--worker-extension-cls", WORKER_EXTENSION,
            "--additional-config", json.dumps(additional), *settings.args, *extra_args]
    return Prepared(args, settings, served, folder, named, global_steer, global_vectors, _ignored(cfg), tokenizer,
                    additional["interp"]["plugin"], cfg.engine.model_runner)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    overrides, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    try:
        prepared = prepare(compose(overrides), extra)
        vllm_args = parse_vllm_args(prepared.vllm_args, [*prepared.settings.args, *extra], prepared.model_runner)
    except COMMAND_LINE_ERRORS as err:
        report(explain(err, overrides, CONF_DIR, CONFIG_NAME))
        sys.exit(EXIT_CODE)
    except ConfigError as err:
        report(err.problems)
        sys.exit(EXIT_CODE)
    if prepared.ignored:
        print(f"interp-serve uses {', '.join(USED_KEYS)} of the config; left out: {', '.join(prepared.ignored)} "
              "(requests carry their own in their interp object)", file=sys.stderr)
    from interp_runner.engine.adapter import model_inspection_in_process
    from interp_runner.serve.server import run

    with model_inspection_in_process():  # the server's process inspects the model: here, on a CPU
        run(vllm_args, prepared)


def parse_vllm_args(args: list[str], given: list[str], model_runner: str = "auto"):
    """vLLM's own parser over the server flags (a flag it refuses is a ``serve.args`` error). ``model_runner``:
    ``engine.model_runner``, set for the engine's processes as ``interp-run`` sets it."""
    from interp_runner.engine.settings import select_model_runner

    os.environ["INTERP_RUNNER_PLUGIN"] = "1"  # read by the plugin in every vLLM process
    select_model_runner(model_runner)
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="interp-serve"))
    parser.exit_on_error = False
    try:
        parsed = parser.parse_args(args)
        validate_parsed_serve_args(parsed)
    except SystemExit:
        raise ConfigError.at("serve.args", f"vLLM refuses the server flags {' '.join(given)!r} given in serve.args "
                                           "or after --") from None
    except Exception as err:  # argparse's and vLLM's own checks
        raise ConfigError.at("serve.args", str(err)) from None
    return parsed


if __name__ == "__main__":
    if not sys.flags.safe_path and sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]  # as ``interp-run``: the repository's kernels/ would shadow a package of that name
    main()
