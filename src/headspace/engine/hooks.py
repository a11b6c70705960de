"""Explicit seams for tests and benchmarks: nothing here is needed to run the engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from headspace.planner.memory import Hardware
from headspace.tiers.cpu_timings import CpuTimings


@dataclass
class EngineHooks:
    """``graphs``: the class that captures and replays decode steps in place of
    :class:`headspace.engine.paged_graphs.DecodeGraphs`, with its constructor's arguments
    (the tests' CPU twin runs the graphs' padded steps eagerly, so their paths run without a
    GPU; under gloo the twin stands in where collectives cannot be captured). None: CUDA
    graphs on a GPU, none on a CPU.

    ``attention_hook``: ``hook(tiers, layer, q, kv) -> out`` called by each layer's
    attention in place of the tiers' (``attend_tiers(tiers, layer, q, kv)`` is theirs; a
    benchmark's timer; eager and graphed steps alike; every lane's runner).
    ``decode_hooks``: each decode step runs as ``hook(seq_ids, step) -> step()``'s result,
    the first hook innermost (timers, profilers and traces; the list is shared, so a hook
    appended later applies too). None and empty by default.

    ``host_arena``: the class of the host pages in place of
    :class:`headspace.kv.host_store.HostKVArena`, with its constructor's arguments (a test's
    arena that cannot grow, as when page-locking fails on one rank). None: HostKVArena.

    ``prefix_piece``: prefix tokens a prefill chunk gathers from its pages at a time (a
    test's small pieces end mid-chunk). None: :func:`headspace.tiers.base.prefix_piece`.

    ``cpu_timings``: a :class:`headspace.tiers.cpu_timings.CpuTimings` the hybrid tier's CPU side
    fills as it runs (each kernel call's seconds, bytes and tokens, the waits for the query
    and the result and when jobs start and end, the sparse selector's host time), and whose
    ``track_weights`` may switch the sparse mode's moving averages off (a benchmark's
    profile). None: nothing recorded.

    ``weight_delay``: ``delay(what, layer)`` with streamed weights
    (:class:`headspace.engine.weight_stream.WeightStream`'s ``delay``): called on the copy
    stream before each layer's copy (``"copy"``) and on the compute stream before each
    layer computes (``"layer"``); a test's ``torch.cuda._sleep`` there makes the copies or
    the layers late. None: none.

    ``hardware``: the planner's rates (:class:`headspace.planner.memory.Hardware`) in place
    of its defaults (a test's, to see a plan follow given rates). None: the defaults.

    ``step_clock``: the seconds the hybrid tier's share search times decode steps by (a
    test's clock, whose steps take what it says a share costs). None: ``time.perf_counter``.

    ``prompt_stand_in``: ``kept(prompt_ids) -> [layers][kv heads]`` tokens each (layer, kv
    head) of the model keeps of that prompt, for a benchmark's decode over pages at given
    lengths without the prompt's compute (an exact decode step's work depends on the
    lengths, not on the values in the pages; the hybrid tier's sparse mode, which selects
    by the values, is not such a step): a prefill then computes nothing, its pages keep
    what they held, a KV budget's entries keep those counts where its policy would have
    picked (a rank's entries: its heads' and its copies'; a streaming head its ring),
    every other entry the whole prompt, and the last position's logits are zeros (a
    greedy first token is token 0). Every rank must be given the same. None: prompts are
    computed.

    ``logits_filter``: ``filter(prompts, logits) -> logits``, called with the token ids of
    each prompt whose next tokens a step picks and their fp32 ``logits [rows, vocab]``
    before the sampled rows pick and the rows are checked for non-finite values (a test's
    non-finite row ends its request alone; greedy picks are made before it, on the
    device). None: the logits as computed.

    ``lane_step``: ``hook(lane_name)``, called on a lane's thread before each of its steps
    ("resident", "offload" or "main"; a test holds the offload lane there to see the
    resident lane's steps go on without it). None: none."""

    graphs: type | None = None
    host_arena: type | None = None
    prefix_piece: int | None = None
    cpu_timings: CpuTimings | None = None
    weight_delay: Callable[[str, int], None] | None = None
    hardware: Hardware | None = None
    step_clock: Callable[[], float] | None = None
    prompt_stand_in: Callable[[list[int]], list[list[int]]] | None = None
    logits_filter: Callable[[list[list[int]], torch.Tensor], torch.Tensor] | None = None
    lane_step: Callable[[str], None] | None = None
    attention_hook: Callable | None = None
    decode_hooks: list[Callable] = field(default_factory=list)
