"""Names a package loads on first use (PEP 562), so that importing it costs nothing until
one is asked for: ``headspace``'s API without torch, and the torch-free parts of ``budgets``
and ``tiers`` (what the command line's flags are built from)."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_names(package: str, homes: dict[str, str]) -> Callable[[str], object]:
    """A ``__getattr__`` for ``package`` that imports each name of ``homes`` from its
    module (a dotted name, or relative to ``package``: ``".spec"``) when it is first
    asked for."""

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(homes[name], package), name)

    return __getattr__
