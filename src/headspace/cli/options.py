"""Command-line flags derived from the documented fields of :class:`EngineConfig` and
:class:`ParallelConfig`."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields

from headspace.engine.config import EngineConfig
from headspace.errors import UserError

MEMORY_FLAGS = ("gpu_memory", "host_memory")


def memory_value(text: str) -> str:
    """A memory budget flag, read as the engine reads it (checked here, so the error names
    the flag)."""
    from headspace.engine.memory import read_memory

    try:
        read_memory(text)
    except UserError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def kv_budget_value(text: str) -> float | int:
    """``--kv-budget``: a fraction of the prompt in (0, 1] (``0.25``) or a token count that
    says so (``2048tok``, ``2048tokens``); a bare number above 1 is refused as ambiguous."""
    tokens = re.fullmatch(r"\s*(\d+)\s*(tok|toks|tokens?)\s*", text, re.IGNORECASE)
    if tokens:
        return int(tokens.group(1))
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r}: give a fraction of the prompt in (0, 1] such as 0.25, or "
            f"a token count such as 2048tok"
        )
    return value


FLAG_TYPES = {"kv_budget": kv_budget_value} | dict.fromkeys(MEMORY_FLAGS, memory_value)


def join_negative_values(argv: list[str]) -> list[str]:
    """``--flag -1GiB`` as ``--flag=-1GiB``: argparse takes a value that starts with a dash
    and is no plain number for a flag, and would say the flag expected an argument."""
    joined, i = [], 0
    while i < len(argv):
        if (argv[i].startswith("--") and "=" not in argv[i] and i + 1 < len(argv)
                and re.match(r"-[0-9.]", argv[i + 1])):  # fmt: skip
            joined.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        joined.append(argv[i])
        i += 1
    return joined


def add_engine_options(p, names: tuple[str, ...] | None = None, defaults: dict | None = None):
    """One flag per :class:`EngineConfig` field (``names``: only these), its documentation
    the help text; ``defaults`` overrides the command line's default of some."""
    add_config_options(p, EngineConfig, names, defaults)


def add_parallel_options(p) -> None:
    """One flag per :class:`ParallelConfig` field."""
    from headspace.parallel.config import ParallelConfig

    add_config_options(p, ParallelConfig)


def add_config_options(p, config_class, names: tuple[str, ...] | None = None,
                       defaults: dict | None = None, hidden: bool = False) -> None:  # fmt: skip
    """One flag per documented field of the dataclass ``config_class``, in the help
    section its ``group`` names, with its default; ``hidden``: taken but not listed."""
    defaults, sections = defaults or {}, {}
    for f in fields(config_class):
        if (names is not None and f.name not in names) or "help" not in f.metadata:
            continue  # a field without help (a nested config) has its own flags
        flag = "--" + f.name.replace("_", "-")
        default = defaults.get(f.name, f.metadata.get("cli_default", f.default))
        help_text = f.metadata["help"].replace("%", "%%")
        if f.name in defaults:
            help_text += f"; here {default}"
        elif f.type == "bool":
            help_text += f" (default: {'on' if default else 'off'})"
        elif default is not None and "default" not in help_text:
            help_text += f" (default: {default})"
        if hidden:
            help_text = argparse.SUPPRESS
        group = f.metadata.get("group", "options")
        if group not in sections:
            sections[group] = p if hidden else p.add_argument_group(group)
        section = sections[group]
        if f.type == "bool":
            section.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                 help=help_text)  # fmt: skip
            continue
        kind = {"int": int, "float": float}.get(f.type.split(" ")[0], str)
        section.add_argument(flag, type=FLAG_TYPES.get(f.name, kind), default=default,
                             choices=f.metadata.get("choices"), help=help_text)  # fmt: skip


def add_engine_parallel_options(p) -> None:
    """The :class:`ParallelConfig` flags a command running the engine under torchrun takes
    (listed in its help where they can act: several GPUs here, or under torchrun)."""
    import os

    import torch

    from headspace.parallel.config import ENGINE_FIELDS, ParallelConfig

    several = torch.cuda.device_count() > 1 or "LOCAL_WORLD_SIZE" in os.environ
    add_config_options(p, ParallelConfig, ENGINE_FIELDS, hidden=not several)


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
