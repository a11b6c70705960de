"""The tiers' settings, without torch (the engine's options and the CLI's flags read them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HybridSettings:
    """The hybrid tier's CPU side: ``threads`` (None: the rank's cores but one), sparse mode's
    ``sparsity`` (beta; None: exact), ``maw_alpha`` and ``query_blocks`` (blocks each step's
    query adds), and the ``gpu_window`` of recent tokens always attended on the GPU. The
    defaults are the engine's (``OffloadConfig``'s)."""

    threads: int | None = None
    sparsity: float | None = None
    maw_alpha: float = 0.1
    gpu_window: int = 1024
    query_blocks: int = 64
