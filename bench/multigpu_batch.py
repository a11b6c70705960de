"""The batch a solver's run of the multi-GPU benchmark serves and times (``bench/multigpu.py``):
its prompts (random token ids, seeded), an untimed warm-up batch, then the timed one."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from common import ran_view
from multigpu_report import layer_floor_tokens
from sparsity import timed_decode
from stand_in import KEPT_FILE
from step_trace import trace_decode_steps


def run_prompts(cfg: dict, args, count: int) -> list[list[int]]:
    """The first ``count`` prompts of the timed batch."""
    return [prompt(cfg, args.context - args.decode, seed=3 + 10 * i) for i in range(count)]


def prompt(cfg: dict, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg["vocab_size"], (length,), generator=generator).tolist()


def entry_tokens_at_end(args, entries, options: dict, profile: str) -> list[list[float]]:
    """Each entry's tokens at the batch's end, a sequence's mean, ``[layers][kv heads]``: a
    streaming entry its ring; else with ``--stand-in`` the measured prompts' counts as the
    batch cycles them, under a KV budget its observation window and the profile's share of
    the rest, else the whole prompt; then the tokens decoded after the first. ``entries``:
    the head map's."""
    from headspace.budgets import KVBudget
    from headspace.planner.profile import Profile, budget_key
    from headspace.planner.sparsity import Pattern, held_tokens

    prompt_len, decoded = args.context - args.decode, args.decode - 1
    layers, kv_heads = 1 + entries[-1].layer, 1 + max(e.kv_head for e in entries)
    kept = [[float(prompt_len)] * kv_heads for _ in range(layers)]
    if args.stand_in:
        counts = json.loads((Path(profile).parent / KEPT_FILE).read_text())
        cycled = [counts[i % len(counts)] for i in range(args.batch)]
        kept = [[sum(c[layer][h] for c in cycled) / len(cycled) for h in range(kv_heads)]
                for layer in range(layers)]  # fmt: skip
    elif "kv_budget" in options:
        budget = KVBudget(options["kv_budget"], options["kv_policy"])
        shares = Profile.load(profile).budget_shares[budget_key(budget.policy, budget.value)]
        window = min(budget.window, prompt_len)
        selectable = budget.tokens(prompt_len) - window
        kept = [[window + share * selectable for share in row] for row in shares]
    for e in entries:
        if Pattern.parse(e.pattern).kind == "streaming":  # a ring keeps its size
            kept[e.layer][e.kv_head] = float(held_tokens(e.pattern, None, prompt_len))
        else:
            kept[e.layer][e.kv_head] += decoded
    return kept


def placement_of(entries) -> list[list]:
    """The head map's ``entries`` as a run records them: ``[layer, kv head, ranks, shares]``
    (shares: a copied head's, one a rank; else empty)."""
    return [[e.layer, e.kv_head, list(e.rank), list(e.shares)] for e in entries]


def decode_layer_floor_bytes(engine, args, options: dict, profile: str) -> int:
    """Bytes a decode step of the batch reads at least, at its end: rank 0's weights and,
    each layer, the K/V its slowest rank reads (:func:`multigpu_report.layer_floor_tokens`:
    every layer ends in an all-reduce; a copy reads its share of its head)."""
    entries = ran_view(engine).plan.head_map.entries
    kept = entry_tokens_at_end(args, entries, options, profile)
    tokens = layer_floor_tokens(placement_of(entries), kept)
    weights = sum(p.nbytes for p in engine.model.parameters())
    return weights + round(args.batch * tokens * engine.lanes.spec.entry_token_bytes)


def check_decode_covers_admission(engine, args) -> None:
    """Refuse, before minutes of warm-up, a ``--decode`` too short for a step of the whole
    batch: while others decode each prompt's prefill takes a step a piece (``min(chunk,
    piece tokens)`` of a batch given at once), so the first prompt must still decode when
    the last one's ends."""
    length, batch = args.context - args.decode, args.batch
    piece = min(engine.lanes.chunk, engine.config.runtime.step_tokens(True, slices=False))
    pieces = -(-length // piece)
    needed = (batch - 1) * pieces + 2
    if batch > 1 and args.decode < needed:
        raise SystemExit(
            f"the batch's last prompt ends its prefill about {batch * pieces} "
            f"steps in: raise --decode to {needed} or more ({args.decode})"
        )


def timed_batch(engine, timer, args, cfg: dict, prompts: list[list[int]],
                solver: str) -> tuple[list, float, float, list]:  # fmt: skip
    """The run's ``prompts``, after an untimed batch of ``--warmup-batch`` prompts as long (by
    default as many) that compiles and tunes the kernels for their shapes (FlexAttention per
    key capacity, cuDNN plans per shape) and captures the decode graphs: every request's
    stats, the prefill seconds, the decode tok/s and the seconds of each step that decoded
    the whole batch (none for one request; with ``--served-rate`` the pace between their
    starts). ``timer``: the attention timer, or None."""
    from headspace.engine.sampling import SamplingParams

    check_decode_covers_admission(engine, args)
    params = SamplingParams(max_new_tokens=args.decode, ignore_eos=True)
    length, batch = args.context - args.decode, args.batch
    warm = args.warmup_batch or batch
    engine.generate_batch([prompt(cfg, length, seed=4 + 10 * i) for i in range(warm)],
                          [params] * warm)  # fmt: skip
    if timer is not None:
        timer.restart(rows=batch if batch > 1 else None)
    steps = timed_decode(engine, batch, not args.served_rate) if batch > 1 else None
    if args.trace:  # a few of the timed steps recorded (they count in the median as any)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        trace_decode_steps(engine, batch, Path(args.trace), f"decode_{solver}_rank{rank}")
    every = [output.stats for output in engine.generate_batch(prompts, [params] * batch)]
    if steps is None:  # one request: its own prefill and decode
        return every, every[0].prefill_seconds, (args.decode - 1) / every[0].decode_seconds, []
    if not steps:  # each prompt's prefill takes a step, in which the others decode
        raise SystemExit(f"no decode step ran all {batch} prompts together: raise "
                         f"--decode above --batch ({args.decode})")  # fmt: skip
    engine.lanes.hooks.decode_hooks.clear()  # the timer (and the trace)
    return every, max(st.prefill_seconds for st in every), batch / statistics.median(steps), steps
