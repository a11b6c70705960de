"""What a benchmark records of the hybrid tier's CPU side: each kernel call (:class:`CpuCall`),
and the seconds of the methods :func:`timed` wraps (:class:`CpuTimings`)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import NamedTuple


class CpuCall(NamedTuple):
    """One call of the hybrid tier's CPU kernel: ``tokens`` summed over its rows (sequences,
    or a sparse row's kept tokens: ``int(ends.sum())``), each over ``kv_heads`` kv heads (K's
    first dimension), in pages of ``page_size`` tokens (1: the sparse rows' token tables);
    ``background``: a native background job (exact mode), else a call on the Python worker."""

    tokens: int
    kv_heads: int
    page_size: int
    background: bool


@dataclass
class CpuTimings:
    """What a benchmark profiling the hybrid tier's CPU side records (given as
    ``EngineHooks.cpu_timings``; None, the default, records nothing and costs one check a
    call). Filled as the engine runs, one entry per call; seconds are wall seconds
    (``time.perf_counter``), bytes those of the K and V the kernel reads.

    ``kernel``: (seconds, bytes) of each CPU kernel call on the Python worker (sparse mode,
    or exact mode without the native runner). ``jobs``: bytes of each native background job
    (exact mode; its kernel runs off Python, so only the wait in ``result`` is timed).
    ``query``: the Python worker's wait for each query to land. ``result``: the GPU thread's
    wait in each ``CpuAttention.result``. ``track``, ``begin``, ``tables``: host seconds in
    each :class:`headspace.tiers.hybrid_sparse.SparseSelector` ``track``, ``begin`` and
    ``token_tables`` call.

    ``calls``: what each kernel call and native job attends (:class:`CpuCall`), as they
    are made. ``submitted``: the GPU thread's ``time.perf_counter()`` (seconds) at each
    ``CpuAttention.submit`` that starts a CPU job; ``collected``: at each ``result``'s return
    (its wait began ``result`` seconds before).

    ``track_weights``: False skips the sparse mode's moving averages of the GPU-side tokens'
    weights (their scores and their update), for profiling only (what tracking costs):
    selections then keep only what the CPU side's own re-evaluations keep."""

    kernel: list[tuple[float, int]] = field(default_factory=list)
    jobs: list[int] = field(default_factory=list)
    query: list[float] = field(default_factory=list)
    result: list[float] = field(default_factory=list)
    track: list[float] = field(default_factory=list)
    begin: list[float] = field(default_factory=list)
    tables: list[float] = field(default_factory=list)
    calls: list[CpuCall] = field(default_factory=list)
    submitted: list[float] = field(default_factory=list)
    collected: list[float] = field(default_factory=list)
    track_weights: bool = True

    def clear(self) -> None:
        """Empty every record (after a warm-up, say); ``track_weights`` stays."""
        for value in vars(self).values():
            if isinstance(value, list):
                value.clear()


def timed(name: str, stamps: str | None = None):
    """Decorates a method of an object with a ``timings`` attribute (a :class:`CpuTimings`
    or None): when set, each call's wall seconds go to its list ``name``, and the
    ``time.perf_counter()`` at its return (seconds) to its list ``stamps``, if given."""

    def decorate(method):
        @functools.wraps(method)
        def call(self, *args, **options):
            if self.timings is None:
                return method(self, *args, **options)
            start = time.perf_counter()
            try:
                return method(self, *args, **options)
            finally:
                end = time.perf_counter()
                getattr(self.timings, name).append(end - start)
                if stamps is not None:
                    getattr(self.timings, stamps).append(end)

        return call

    return decorate


__all__ = ["CpuCall", "CpuTimings", "timed"]
