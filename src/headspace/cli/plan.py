"""``headspace plan``: the head map, memory table and predicted speed, before anything runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

from headspace.cli.balance import format_balance, plan_balance
from headspace.cli.commands import COMMAND_HELP
from headspace.cli.options import add_engine_options, add_parallel_options, parallel_config
from headspace.errors import HostBudgetError, UserError
from headspace.kv.spec import byte_size

GiB = 2**30


def parse_tokens(text: str) -> int:
    """``"1M"`` = 1,048,576, ``"512K"`` = 524,288, or a plain count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", str(text))
    if not match:
        raise UserError(f"cannot read context {text!r} (use e.g. 32768, 128K or 1M)")
    scale = {"": 1, "k": 2**10, "m": 2**20}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def add_plan_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help=COMMAND_HELP["plan"])
    p.add_argument(
        "--model", help="checkpoint directory, config.json, or .gguf (default: embedded)"
    )
    p.add_argument("--context", required=True, help="context length, e.g. 131072, 128K, 1M")
    # the engine's own flags for what a plan depends on (the GPU's memory unless given)
    planned = ("gpu_memory", "host_memory", "offload", "cpu_share", "gpu_window",
               "window_on_gpu", "head_group", "prefill_chunk", "page_size", "dtype", "profile",
               "retrieval_heads", "sparse_pattern", "kv_budget", "kv_policy",
               "weights")  # fmt: skip
    add_engine_options(p, planned, {"dtype": "bfloat16"})  # the engine's defaults otherwise
    add_parallel_options(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _model_config(model: str | None):
    from headspace.model.config import load_config
    from headspace.model.source import resolve_model_dir

    if model and Path(model).is_file() and Path(model).suffix == ".json":
        return load_config(Path(model).parent) if Path(model).name == "config.json" else None
    return load_config(resolve_model_dir(model))


def _gpu_budget(args, config) -> int:
    import torch

    from headspace.engine.memory import default_gpu_budget, device_total_bytes, parse_memory

    if args.gpu_memory is None and not torch.cuda.is_available():
        host = (
            ""
            if args.host_memory is not None
            else (" and --host-memory (its machine's, e.g. 200GiB; this one's is used otherwise)")
        )
        raise UserError(f"no GPU here: pass --gpu-memory (e.g. 24GiB){host} to plan for one")
    if args.gpu_memory is None:  # what an engine made now on this GPU would hold
        from headspace.planner.memory import weight_bytes

        itemsize = 4 if args.dtype == "float32" else 2
        return default_gpu_budget(torch.device("cuda"), 0, weight_bytes(config, itemsize))
    gpu_total = device_total_bytes(torch.device("cuda")) if torch.cuda.is_available() else 0
    return parse_memory(args.gpu_memory, gpu_total)


def _host_hint(make, args):
    """``make()``; a refusal for want of host memory, with no --host-memory given, says
    that the budget was this machine's and which flag sets the planned one's."""
    try:
        return make()
    except HostBudgetError as error:
        if args.host_memory is not None:
            raise
        raise UserError(f"{error} (this machine's available memory: --host-memory sets the "
                        f"planned machine's)") from None  # fmt: skip


def run_plan(args) -> None:
    from dataclasses import replace

    from headspace.engine.memory import rank_host_bytes
    from headspace.parallel.rank_plan import page_heads, plan_for_ranks
    from headspace.planner import make_plan
    from headspace.planner.profile import Profile, budget_key

    context = parse_tokens(args.context)
    config = _model_config(args.model)
    if config is None:
        raise UserError(f"{args.model} is not a config.json")
    parallel = parallel_config(args)
    profile = Profile.load(args.profile) if args.profile else None
    gpu = _gpu_budget(args, config)
    request = _request(args, config, profile, context, gpu)
    share_key = None if args.kv_budget is None else budget_key(args.kv_policy, args.kv_budget)
    chosen, uniform = plan_balance(config, request, parallel, profile, share_key)
    shard, ranks = {}, 1
    if chosen is not None:  # the ranks on one machine divide its memory, as the engine does
        shard = {"world": parallel.gpus, "kv_heads": page_heads(chosen.head_map, parallel.gpus)}
        ranks = parallel.gpus
    layers = _streamed_layer_bytes(config, args, gpu, request.dtype_bytes, **shard)
    host = rank_host_bytes(args.host_memory, ranks, ranks * layers)
    request = replace(request, host_memory=host)
    if chosen is None:
        plan = _host_hint(lambda: make_plan(config, request), args)
    else:  # the widest rank's part, as the engine plans it under torchrun
        plan = _host_hint(
            lambda: plan_for_ranks(config, request, chosen.head_map, parallel.gpus), args
        )
    if args.json:
        print(json.dumps(_plan_json(config, request, plan, parallel, chosen, uniform), indent=2))
        return
    print(format_plan(config, request, plan, parallel.gpus))
    if context > config.max_context:  # generate refuses it without --max-context
        print(f"\nnote: {context:,} tokens is past the model's trained context of "
              f"{config.max_context:,}; generate runs it only with "
              f"--max-context {context}")  # fmt: skip
    if chosen is not None:
        print("\n" + format_balance(config, request, parallel, chosen, uniform))


def _request(args, config, profile, context: int, gpu: int):
    """The :class:`PlanRequest` of the options (its host budget filled in later)."""
    from headspace.planner import PlanRequest

    budget_tokens, entry_bound = _budget_tokens(args, context)
    return PlanRequest(context, gpu, 0, 4 if args.dtype == "float32" else 2, args.offload,
                       args.head_group, args.prefill_chunk, args.page_size, args.cpu_share,
                       args.gpu_window, budget_tokens, entry_bound, weights=args.weights,
                       window_on_gpu=args.window_on_gpu,
                       **_patterns(args, config, profile))  # fmt: skip


def _plan_json(config, request, plan, parallel, chosen, uniform) -> dict:
    """The plan as JSON; over several GPUs the balance's loads instead of one rank's
    roofline."""
    header = {"model": config.architecture, "context": request.context,
              "gpu_memory": request.gpu_memory, "host_memory": request.host_memory,
              "gpus": parallel.gpus}  # fmt: skip
    planned = plan.to_dict()
    if chosen is None:
        return {**header, **planned}
    for key in ("prefill_tok_s", "decode_ms", "decode_pcie_floor_ms"):
        planned.pop(key)
    loads = {"solver": parallel.balance, "phase": chosen.phase,
             "decode_batch": parallel.balance_batch, "loads": chosen.loads,
             "uniform": uniform.loads}  # fmt: skip
    return {**header, **planned, "balance": loads}


def _streamed_layer_bytes(config, args, gpu: int, dtype_bytes: int, **shard) -> int:
    """Host bytes of one rank's decoder layers when they stream (decided as ``make_plan``
    decides; ``shard``: a rank's part, ``world`` and ``kv_heads``), 0 when resident."""
    from headspace.planner.memory import WeightSpec, streams_weights

    streamed = streams_weights(args.weights, config, gpu, dtype_bytes, chunk=args.prefill_chunk,
                               **shard)  # fmt: skip
    return WeightSpec.of(config, dtype_bytes, streamed, **shard).host_bytes


def _budget_tokens(args, context: int) -> tuple[int | None, int | None]:
    """Tokens kept per entry after the prompt under ``--kv-budget`` and the most one entry
    may hold (a policy that shares a total may give one entry everything); None: all."""
    from headspace.budgets import KVBudget

    if args.kv_budget is None:
        return None, None
    try:
        budget = KVBudget(args.kv_budget, args.kv_policy)
    except ValueError as error:
        raise UserError(str(error)) from None
    return budget.tokens(context), budget.most_held(context, context)


def _patterns(args, config, profile) -> dict:
    """The request's pattern fields from the ``--profile`` (none without one, nor without
    ``--retrieval-heads``: every head keeps every token, as the engine's default)."""
    from headspace.kv.spec import Pattern

    if profile is None:
        return {}
    try:
        sparse = str(Pattern.parse(args.sparse_pattern))
    except ValueError as exc:
        raise UserError(f"--sparse-pattern: {exc}") from None
    if args.retrieval_heads is None:
        return {}
    profile.check(config.num_layers, config.num_kv_heads)
    retrieval = tuple(tuple(row) for row in profile.retrieval)
    return {"retrieval": retrieval, "retrieval_heads": args.retrieval_heads,
            "sparse_pattern": sparse}  # fmt: skip


def _weights_line(config, request, memory) -> str:
    if not memory["weights_host"]:
        return f"resident on the GPU (asked: {request.weights})"
    layer = memory["weights_host"] / config.num_layers
    return (
        f"decoder layers streamed from pinned host memory, each copied to the GPU while "
        f"the one before computes ({byte_size(layer)} a layer; asked: {request.weights})"
    )


def format_plan(config, request, plan, gpus: int = 1) -> str:
    """The human-readable plan: model line, memory table, head map, prediction; over
    ``gpus`` ranks, the widest rank's memory and the whole head map (the balance that
    follows predicts each rank's attention)."""
    m, staging = plan.memory, plan.staging
    groups = ""
    if staging:
        groups = (f", {staging.group} head(s) per streamed group, {staging.depth} staging "
                  f"slots of {staging.piece_pages} pages")  # fmt: skip
    elif plan.entry_staging:  # entries of their own pages: one slot per layer's copy
        groups = (
            f", {plan.head_map.num_offloaded} entries in host pages, each streaming "
            f"what it keeps through 2 staging slots of {plan.entry_staging} entry pages"
        )
    lines = [
        f"model {config.architecture}: {config.num_layers} layers, {config.num_heads}/"
        f"{config.num_kv_heads} heads, head dim {config.head_dim}; "
        f"KV {config.kv_bytes_per_token * request.dtype_bytes // 2 / 1024:.0f} KiB per token",
        f"context {request.context:,} tokens; GPU budget {byte_size(request.gpu_memory)}, "
        f"host budget {byte_size(request.host_memory)}{' a rank' if gpus > 1 else ''}; "
        f"offload {plan.offload} "
        f"(asked: {request.offload}){groups}",
        f"weights: {_weights_line(config, request, m)}",
        *_ranks_lines(plan, gpus),
        "",
        f"{'memory':<34}{'GPU GiB':>10}{'host GiB':>10}",
        f"{'weights':<34}{m['weights'] / GiB:>10.2f}{m['weights_host'] / GiB:>10.2f}",
        f"{'KV pool (resident heads)':<34}{m['gpu_pool'] / GiB:>10.2f}",
        f"{'  of which this context':<34}{m['gpu_kv'] / GiB:>10.2f}",
        f"{'  held after the prompt':<34}{m['kv_held'] / GiB:>10.2f}",
        f"{'KV pages on the host':<34}{'':>10}{m['host_kv'] / GiB:>10.2f}",
        f"{'staging (streamed groups)':<34}{m['staging'] / GiB:>10.2f}",
        f"{'GPU window (hybrid heads)':<34}{m['gpu_window'] / GiB:>10.2f}",
        f"{f'activations ({plan.prefill_chunk}-token chunk)':<34}{m['activations'] / GiB:>10.2f}",
        f"{'allocator slack':<34}{m['allocator_slack'] / GiB:>10.2f}",
        f"{'batched decode':<34}{m['decode'] / GiB:>10.2f}",
        f"{'keys a layer gathers (patterns)':<34}{m['gathered'] / GiB:>10.2f}",
        f"{'total':<34}{m['total_gpu'] / GiB:>10.2f}{m['total_host'] / GiB:>10.2f}",
        "",
        f"head map: {plan.head_map.summary()}",
        plan.head_map.grid(),
        plan.head_map.legend(),
    ]
    if gpus == 1:
        lines += ["", f"predicted (roofline): prefill {plan.prefill_tok_s:,.0f} tok/s; decode "
                  f"{plan.decode_ms:,.1f} ms/token (PCIe floor "
                  f"{plan.decode_pcie_floor_ms:,.1f} ms)"]  # fmt: skip
    return "\n".join(lines)


def _ranks_lines(plan, gpus: int) -> list[str]:
    """Under head parallelism: whose memory the table shows."""
    if gpus == 1:
        return []
    from headspace.parallel.rank_plan import page_heads

    widest = page_heads(plan.head_map, gpus)
    return [f"per GPU: each of {gpus} ranks holds its kv heads' weights (at most {widest} a "
            f"layer, copies included) and 1/{gpus} of the MLP; the memory below is the "
            f"widest rank's, its KV pages {widest} kv head{'s' if widest > 1 else ''} wide; "
            f"the ranks share the host budget (one machine)"]  # fmt: skip
