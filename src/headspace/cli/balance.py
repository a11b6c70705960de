"""``headspace plan --gpus N``: the head map's ranks, each rank's load and KV, the imbalance
and the predicted step time of the chosen solver, beside uniform's."""

from __future__ import annotations

from headspace.kv.spec import GiB


def plan_balance(config, request, parallel, profile=None, share_key: str | None = None):
    """The :class:`Balance` of the request's head map over ``parallel.gpus`` ranks, and
    uniform's for comparison (None when one GPU). The map is the one the engine balances
    under torchrun: every entry on the GPU with its pattern and, with per-entry pages, its
    budget; with the profile's measured budget shares under ``share_key`` ("POLICY
    BUDGET"), each budgeted entry's cost is its share of the budget."""
    from dataclasses import replace

    from headspace.parallel.balance import balance_heads, check_balance, priced_map
    from headspace.planner.head_cost import CostShape
    from headspace.planner.head_map import HeadMap

    if parallel.gpus == 1:
        return None, None
    check_balance(parallel, config.num_kv_heads)
    head_map = request.with_patterns(HeadMap.all_gpu(config.num_layers, config.num_kv_heads))
    shares = profile.budget_shares.get(share_key) if profile is not None else None
    head_map = priced_map(head_map, request.per_head_pages, request.budget_tokens, shares)
    shape = CostShape.of(config, request.dtype_bytes)
    options = {"context": request.context, "chunk": request.prefill_chunk, "profile": profile,
               "batch": parallel.balance_batch}  # fmt: skip
    chosen = balance_heads(head_map, shape, parallel, **options)
    uniform = balance_heads(head_map, shape, replace(parallel, balance="uniform"), **options)
    return chosen, uniform


def format_balance(config, request, parallel, chosen, uniform) -> str:
    """Per-rank table (heads, KV held, load per phase) and the imbalance and step time of the
    chosen solver against uniform."""
    from headspace.parallel.rank_plan import rank_kv

    gpus, head_bytes = parallel.gpus, 2 * config.head_dim * request.dtype_bytes
    held = rank_kv(chosen.head_map, gpus, request.context, tier=None)  # a copy: all its KV
    heads = [num / config.num_layers for num, _ in held]
    kv = [tokens * head_bytes for _, tokens in held]
    lines = [f"balance {parallel.balance} over {gpus} GPUs ({parallel.replicas} extra copies "
             f"a layer allowed, {chosen.loads['decode']['extra_copies']} made); balanced: "
             f"{chosen.phase} costs (roofline at the planner's rates, decode at batch "
             f"{parallel.balance_batch})",  # fmt: skip
             f"{'rank':>4}{'kv heads/layer':>16}{'KV GiB':>9}{'prefill chunk ms':>18}"
             f"{'decode ms':>11}"]  # fmt: skip
    prefill, decode = (chosen.loads[p]["rank_seconds"] for p in ("prefill", "decode"))
    for rank in range(gpus):
        lines.append(f"{rank:>4}{heads[rank]:>16.2f}{kv[rank] / GiB:>9.2f}"
                     f"{1e3 * prefill[rank]:>18.2f}{1e3 * decode[rank]:>11.3f}")  # fmt: skip
    for phase in ("prefill", "decode"):
        mine, theirs = chosen.loads[phase], uniform.loads[phase]
        lines.append(
            f"{phase}: imbalance (max/mean) {mine['imbalance_max_over_mean']:.3f} (uniform "
            f"{theirs['imbalance_max_over_mean']:.3f}); attention step "
            f"{1e3 * mine['step_seconds']:.2f} ms (uniform {1e3 * theirs['step_seconds']:.2f})"
        )
    return "\n".join(lines)
