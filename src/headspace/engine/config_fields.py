"""How an engine option group's fields are declared and checked: a documented field
(:func:`_option`: its help text, flat name and command-line default), the choices its
``Literal`` type allows, and the checks that refuse other values with one line. Pure
Python, no torch."""

from __future__ import annotations

from dataclasses import field, fields
from typing import Literal, get_args, get_origin, get_type_hints

from headspace.errors import UserError

# a step's prompt work beside decoding requests, by default: small while requests arrive one
# by one and a chunk runs in layer slices (their time per output token stays within a few
# times its usual value), large for a batch given at once (fewer, fuller steps) and for
# pieces through every layer (each re-reads the prompt's prefix), as vLLM sizes its token
# budget by usage
ARRIVING_STEP_TOKENS, AT_ONCE_STEP_TOKENS = 512, 8192
# the running requests' time per token while prompts queue, as a multiple of their decode
# step alone (the short streams' p99 target of issue 72 during a long prefill)
PREFILL_SLOWDOWN = 3.0
# ... and where a prompt's piece rides in the decode rows' forward (mixed steps) for requests
# arriving one by one, always. A burst of 16 prompts on an H100 (bench/RESULTS.md): at 1.5 its
# time per token was 1.35x its HBM roofline and its first tokens 1.2x the prefill bound
# (issue 73's caps: 1.5x and 1.3x); at 1.3 the same time per token and first tokens 1.26-1.59x;
# at 1.6 first tokens 1.03x and a token 1.51x (pieces come in whole pages: a coarse knob)
MIXED_SLOWDOWN = 1.5
# with prompt_order "shortest", the shortest waiting prompt is admitted first, but none is passed
# over by more than this many later ones: a burst of 16 prompts is taken shortest first, a long
# prompt among steady short ones waits at most 16 of their prefills longer than in arrival order
ORDER_PASSES = 16
# beside decoding requests on a GPU, the share of its SMs a long prompt's pieces in the offload
# lane may use (a CUDA green context): the rest are always free for the others' decode steps,
# whose kernels otherwise wait for the prompt's long attention blocks to leave an SM. All by
# default: on an H100, 0.85 brought the short streams' p99 during a 128K prefill from 5.7x to
# 2.6x their pace alone, but their p50 from 1.02x to 1.42x and the long request's first token
# from 1.14x to 1.46x its time alone (bench/NOTES.md)
PREFILL_SM_SHARE = 1.0


def _option(default, help: str, *, flag: str | None = None, cli_default=None):
    """A documented field: ``help`` is its flag's help text; ``flag`` its flat name (API
    keyword and ``--flag``) when it differs from the field's; ``cli_default`` the command
    line's default when it differs from the API's."""
    meta = {"help": help, "flag": flag, "cli_default": cli_default}
    return field(default=default, metadata={k: v for k, v in meta.items() if v is not None})


def choices(config_class, optional: bool = False) -> dict[str, tuple]:
    """Each field of ``config_class`` typed by a ``Literal``: its allowed values (with
    ``optional``, None too where the type allows it)."""
    found = {}
    for name, hint in get_type_hints(config_class).items():
        options = [hint] + list(get_args(hint))  # Literal[...] or Literal[...] | None
        literal = next((o for o in options if get_origin(o) is Literal), None)
        if literal is not None:
            found[name] = get_args(literal) + ((None,) if optional and None in options else ())
    return found


def check_choices(config) -> None:
    """UserError naming the first field whose value its type does not allow."""
    for name, allowed in choices(type(config), optional=True).items():
        value = getattr(config, name)
        if value not in allowed:
            flag = flat_name(next(f for f in fields(config) if f.name == name))
            named = ", ".join(str(a) for a in allowed if a is not None)
            raise UserError(f"{flag} must be one of {named}, got {value!r}")


def flat_name(f) -> str:
    """A field's API keyword and flag name."""
    return f.metadata.get("flag", f.name)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive_ints(config, names: tuple[str, ...], optional: bool) -> None:
    for name in names:
        value = getattr(config, name)
        if (value is not None or not optional) and (type(value) is not int or value < 1):
            raise UserError(f"{name} must be a positive integer, got {value}")


__all__ = ["_is_number", "_option", "_positive_ints", "check_choices", "choices", "flat_name"]
