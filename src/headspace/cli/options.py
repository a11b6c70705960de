"""Command-line flags derived from the documented fields of :class:`EngineConfig` and
:class:`ParallelConfig`."""

from __future__ import annotations

import argparse
from dataclasses import fields

from headspace.engine.config import EngineConfig


def add_engine_options(p, names: tuple[str, ...] | None = None, defaults: dict | None = None):
    """One flag per :class:`EngineConfig` field (``names``: only these), its documentation
    the help text; ``defaults`` overrides the command line's default of some."""
    add_config_options(p, EngineConfig, names, defaults)


def add_parallel_options(p) -> None:
    """One flag per :class:`ParallelConfig` field."""
    from headspace.parallel.config import ParallelConfig

    add_config_options(p, ParallelConfig)


def add_config_options(p, config_class, names: tuple[str, ...] | None = None,
                       defaults: dict | None = None) -> None:  # fmt: skip
    """One flag per documented field of the dataclass ``config_class``."""
    defaults = defaults or {}
    for f in fields(config_class):
        if (names is not None and f.name not in names) or "help" not in f.metadata:
            continue  # a field without help (a nested config) has its own flags
        flag = "--" + f.name.replace("_", "-")
        default = defaults.get(f.name, f.metadata.get("cli_default", f.default))
        help_text = f.metadata["help"].replace("%", "%%")
        if f.name in defaults:
            help_text += f"; here {default}"
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                           help=help_text)  # fmt: skip
            continue
        kind = {"int": int, "float": float}.get(f.type.split(" ")[0], str)
        p.add_argument(flag, type=kind, default=default, choices=f.metadata.get("choices"),
                       help=help_text)  # fmt: skip


def add_engine_parallel_options(p) -> None:
    """The :class:`ParallelConfig` flags a command running the engine under torchrun takes."""
    from headspace.parallel.config import ENGINE_FIELDS, ParallelConfig

    add_config_options(p, ParallelConfig, ENGINE_FIELDS)


def engine_options(args) -> dict:
    """LLM keyword arguments: every EngineConfig flag, as parsed, and the head-parallel
    ones where the command has them."""
    options = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if "help" in f.metadata}
    from headspace.parallel.config import ENGINE_FIELDS

    options.update({name: getattr(args, name) for name in ENGINE_FIELDS if hasattr(args, name)})
    return options


def parallel_config(args):
    """The :class:`ParallelConfig` of the parsed flags (UserError on a bad value)."""
    from headspace.parallel.config import ParallelConfig

    return ParallelConfig(**{f.name: getattr(args, f.name) for f in fields(ParallelConfig)})
