"""Hydra's errors about a command line, told as config errors: the key at fault, why, and the closest valid name.

Hydra reports a bad override, experiment or config group option itself and exits 1; ``interp-run`` has it raise
them instead and explains them here, to exit 2 as for any bad config. Finding the override at fault composes the
config again override by override: only on this failure path.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import create_config_search_path, get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import (
    ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException, SearchPathException,
)
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

# what a bad command line or config raises while Hydra composes or resolves it
COMMAND_LINE_ERRORS = (ConfigCompositionException, OverrideParseException, SearchPathException, OmegaConfBaseException)


def explain(err: Exception, argv: list[str], conf_dir: str, config_name: str) -> list[tuple[str, str]]:
    """(key, reason) for an error of ``COMMAND_LINE_ERRORS`` that ``interp-run argv`` raised."""
    if isinstance(err, OmegaConfBaseException):  # an interpolation the resolved config could not resolve
        return [(getattr(err, "full_key", None) or "<config>", _message(err))]
    args = get_args_parser().parse_args(argv)
    search_path = create_config_search_path(f"file://{conf_dir}")
    if args.config_dir is not None and os.path.isdir(args.config_dir):  # --config-dir: searched first, as by Hydra
        search_path.prepend(provider="command-line", path=f"file://{os.path.abspath(args.config_dir)}")
    loader = ConfigLoaderImpl(config_search_path=search_path)
    if isinstance(err, MissingConfigException) and "/" in (err.missing_cfg_file or ""):
        group, _, name = err.missing_cfg_file.rpartition("/")
        return [(group, _no_option(group, name, err.options or _options(loader, group)))]
    parser = OverridesParser.create(config_loader=loader)
    parsed: list[Override] = []
    for text in args.overrides:
        try:
            parsed.append(parser.parse_override(text))
        except HydraException as bad:
            return [(_key_of(text), f"cannot parse {text!r}: {_message(bad)}")]
    head: list[str] = []
    for override in parsed:
        for text in _jobs_of(override, args.multirun):
            try:
                loader.load_configuration(config_name, head + [text], run_mode=RunMode.RUN)
            except COMMAND_LINE_ERRORS as found:
                return [(override.key_or_group, _reason(found, override, text, loader, config_name, head))]
        head.append(next(_jobs_of(override, args.multirun)))
    return [("<command line>", _message(err))]


def _jobs_of(override: Override, multirun: bool) -> Iterator[str]:
    """The override as one job of a sweep sees it: each value of a sweep in turn (multirun), else as written."""
    if multirun and override.is_discrete_sweep():
        for value in override.sweep_string_iterator():
            yield f"{override.get_key_element()}={value}"
    else:
        yield override.input_line


def _reason(err: Exception, override: Override, text: str, loader, config_name: str, head: list[str]) -> str:
    if isinstance(err, MissingConfigException) and "/" in (err.missing_cfg_file or ""):
        group, _, name = err.missing_cfg_file.rpartition("/")
        return _no_option(group, name, err.options or _options(loader, group))
    if isinstance(err.__cause__, (ConfigAttributeError, ConfigKeyError)) and override.type == OverrideType.CHANGE:
        before = loader.load_configuration(config_name, head, run_mode=RunMode.RUN)
        return f"no such key (to add one: +{text}){_closest(override.key_or_group, _key_paths(before))}"
    return _message(err)


def _no_option(group: str, name: str, options: list[str]) -> str:
    listed = ", ".join(options) if options else "none"
    return f"no {group} {name!r} (there are: {listed}){_closest(name, options)}"


def _options(loader: ConfigLoaderImpl, group: str) -> list[str]:
    try:
        return loader.get_group_options(group)
    except HydraException:
        return []


def _closest(name: str, candidates: list[str]) -> str:
    """"; did you mean ..." for a close candidate: a key beside ``name`` with a close last part, or where ``name``
    has no parent in the config, a close key anywhere."""
    parent, _, leaf = name.rpartition(".")
    beside = {c.rpartition(".")[2]: c for c in candidates if c.rpartition(".")[0] == parent}
    if beside:
        match = [beside[m] for m in difflib.get_close_matches(leaf, list(beside), n=1)]
    else:
        match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.8)
    return f"; did you mean {match[0]!r}?" if match else ""


def _key_paths(cfg: DictConfig) -> list[str]:
    """Every key of the config but Hydra's own, as dotted paths."""
    def walk(node: dict, prefix: str) -> Iterator[str]:
        for key, value in node.items():
            yield f"{prefix}{key}"
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")

    data = OmegaConf.to_container(cfg, resolve=False)
    data.pop("hydra", None)
    return list(walk(data, ""))


def _key_of(text: str) -> str:
    """The key an override names: ``+engine.foo=1`` -> ``engine.foo``."""
    return text.partition("=")[0].lstrip("+~").partition("@")[0] or text


def _message(err: Exception) -> str:
    """Hydra's message on one line, without its listing of the config search path."""
    text = str(err).split("Config search path:")[0]
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("See https://")]
    return " ".join(lines) or type(err).__name__
