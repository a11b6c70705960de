"""Command-line flags derived from the documented fields of the engine's option groups
(:mod:`headspace.engine.config`) and :class:`ParallelConfig`."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from typing import get_args, get_type_hints

from headspace.engine.config import GROUPS, flat_fields
from headspace.engine.config_fields import choices, flat_name
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
    """One flag per field of the engine's option groups (``names``: only these flat
    names), its documentation the help text, one help section per group; ``defaults``
    overrides the command line's default of some."""
    sections: dict = {}  # the memory and host-tier groups share a section
    for group in GROUPS.values():
        add_config_options(p, group, names, defaults, sections=sections)


def add_parallel_options(p) -> None:
    """One flag per :class:`ParallelConfig` field."""
    from headspace.parallel.config import ParallelConfig

    add_config_options(p, ParallelConfig)


def add_config_options(p, config_class, names: tuple[str, ...] | None = None,
                       defaults: dict | None = None, hidden: bool = False,
                       sections: dict | None = None) -> None:  # fmt: skip
    """One flag per documented field of the dataclass ``config_class``, in the help
    section it names (``SECTION``; ``sections``: those made so far, by title), with its
    default and its ``Literal`` choices; ``hidden``: taken but not listed."""
    defaults, section = defaults or {}, None
    sections = {} if sections is None else sections
    hints, allowed = get_type_hints(config_class), choices(config_class)
    for f in fields(config_class):
        name = flat_name(f)
        if (names is not None and name not in names) or "help" not in f.metadata:
            continue
        if section is None:  # made on the first flag it lists
            title = config_class.SECTION
            if title not in sections:
                sections[title] = p if hidden else p.add_argument_group(title)
            section = sections[title]
        default = defaults.get(name, f.metadata.get("cli_default", f.default))
        help_text = f.metadata["help"].replace("%", "%%")
        is_bool = hints[f.name] is bool
        if name in defaults:
            help_text += f"; here {default}"
        elif is_bool:
            help_text += f" (default: {'on' if default else 'off'})"
        elif default is not None and "default" not in help_text:
            help_text += f" (default: {default})"
        if hidden:
            help_text = argparse.SUPPRESS
        flag = "--" + name.replace("_", "-")
        if is_bool:
            section.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                 help=help_text, dest=name)  # fmt: skip
            continue
        section.add_argument(flag, type=FLAG_TYPES.get(name, _value_type(hints[f.name])),
                             default=default, choices=allowed.get(f.name), help=help_text,
                             dest=name)  # fmt: skip


def _value_type(hint):
    """What a flag's text is read as: the first type its hint allows, where an int or a
    float; else text (a ``Literal``'s choices are text)."""
    first = next(kind for kind in (get_args(hint) or (hint,)) if kind is not type(None))
    return first if first in (int, float) else str


def add_engine_parallel_options(p) -> None:
    """The :class:`ParallelConfig` flags a command running the engine under torchrun takes
    (listed in its help where they can act: several GPUs here, or under torchrun)."""
    import os

    from headspace.parallel.config import ENGINE_FIELDS, ParallelConfig
    from headspace.parallel.launch import visible_gpus

    several = visible_gpus() > 1 or "LOCAL_WORLD_SIZE" in os.environ
    add_config_options(p, ParallelConfig, ENGINE_FIELDS, hidden=not several)


def engine_options(args) -> dict:
    """LLM keyword arguments: every engine option's flag, as parsed, and the head-parallel
    ones where the command has them."""
    from headspace.parallel.config import ENGINE_FIELDS

    options = {name: getattr(args, name) for name in flat_fields()}
    options.update({name: getattr(args, name) for name in ENGINE_FIELDS if hasattr(args, name)})
    return options


def parallel_config(args):
    """The :class:`ParallelConfig` of the parsed flags (UserError on a bad value)."""
    from headspace.parallel.config import ParallelConfig

    return ParallelConfig(**{f.name: getattr(args, f.name) for f in fields(ParallelConfig)})
