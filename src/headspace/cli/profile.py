"""``headspace profile``: per-head retrieval scores of a model and per-pattern attention costs
of this device, written as a JSON profile (and a heatmap) for ``plan --profile``."""

from __future__ import annotations

from pathlib import Path

from headspace.cli.commands import COMMAND_HELP
from headspace.errors import UserError

# the budget whose per-head shares the profile records (FairKV's profile of Ada-SnapKV)
SHARE_POLICY, SHARE_BUDGET = "ada_snapkv", 0.25


def add_profile_parser(subparsers, add_engine_options) -> None:
    p = subparsers.add_parser("profile", help=COMMAND_HELP["profile"])
    p.add_argument("--model", help="checkpoint directory or .gguf file (default: embedded model)")
    p.add_argument("--lengths", default="1k,2k", help="needle prompt lengths")
    p.add_argument("--depths", default="10,50,90", help="needle depths in percent")
    p.add_argument("--contexts", default="2k,8k", help="context lengths of the pattern costs")
    p.add_argument("--chunk", type=int, default=1024, help="queries per timed prefill chunk")
    p.add_argument("--output", default="profile.json", help="the JSON profile (a PNG beside it)")
    add_engine_options(p, ("device", "dtype"))


def run_profile(args) -> None:
    import torch

    from headspace.budgets import KVBudget
    from headspace.cli.plan import parse_tokens
    from headspace.engine.config import EngineConfig
    from headspace.engine.engine import Engine
    from headspace.eval.profile import budget_shares, pattern_costs, retrieval_scores
    from headspace.model.source import resolve_model_dir
    from headspace.planner.profile import Profile, budget_key

    if args.chunk < 1:
        raise UserError(f"--chunk must be a positive number of queries, got {args.chunk}")
    lengths = [parse_tokens(x) for x in args.lengths.split(",") if x.strip()]
    contexts = [parse_tokens(x) for x in args.contexts.split(",") if x.strip()]
    depths = [float(x) for x in args.depths.split(",") if x.strip()]
    config = EngineConfig.of(device=args.device, dtype=args.dtype)
    model_dir = resolve_model_dir(args.model, config.runtime.dtype)
    engine = Engine(model_dir, config)
    model_config = engine.model.config

    def encode(text: str) -> list[int]:
        return engine.encode(text, chat=engine.tokenizer.chat_template is not None)

    scores, cases, prompts = retrieval_scores(engine.model, engine.tokenizer, encode, lengths,
                                              depths)  # fmt: skip
    shares = {budget_key(SHARE_POLICY, SHARE_BUDGET): budget_shares(
        engine.model, prompts, KVBudget(SHARE_BUDGET, SHARE_POLICY)).tolist()}  # fmt: skip
    group = model_config.num_heads // model_config.num_kv_heads
    costs = pattern_costs(group, model_config.head_dim, contexts, args.chunk, args.device,
                          num_kv_heads=model_config.num_kv_heads)  # fmt: skip
    profile = Profile(model=str(model_dir), num_layers=model_config.num_layers,
                      num_kv_heads=model_config.num_kv_heads,
                      retrieval=[[round(x, 5) for x in row] for row in scores.tolist()],
                      device=_device_name(args.device, torch), chunk=args.chunk,
                      pattern_ms=costs, cases=cases,
                      budget_shares=_rounded(shares))  # fmt: skip
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    profile.save(output)
    _heatmap(scores, output.with_suffix(".png"))
    print(_report(profile, scores))
    print(f"wrote {output} and {output.with_suffix('.png')}")


def _device_name(device: str, torch) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def _rounded(shares: dict) -> dict:
    return {key: [[round(x, 4) for x in row] for row in rows] for key, rows in shares.items()}


def _report(profile, scores) -> str:
    flat = sorted(((v, layer, head) for layer, row in enumerate(scores.tolist())
                   for head, v in enumerate(row)), reverse=True)  # fmt: skip
    lines = [f"retrieval scores of {len(flat)} (layer, kv head) entries over "
             f"{len(profile.cases)} needle cases: top five"]  # fmt: skip
    lines += [f"  layer {layer:>3} kv head {head}: {value:.3f}" for value, layer, head in flat[:5]]
    median = flat[len(flat) // 2][0]
    lines.append(f"  median {median:.3f}, lowest {flat[-1][0]:.3f}")
    for key, rows in profile.budget_shares.items():
        values = [x for row in rows for x in row]
        lines.append(f"budget shares ({key}, of an even share): lowest {min(values):.2f}, "
                     f"highest {max(values):.2f}")  # fmt: skip
    contexts = sorted({c for costs in profile.pattern_ms.values() for c in costs}, key=int)
    lines.append(f"\n{'pattern (ms, one kv head)':<28}" + "".join(f"{c:>10}" for c in contexts))
    for pattern, costs in profile.pattern_ms.items():
        lines.append(f"{pattern:<28}" + "".join(f"{costs[c]:>10.2f}" for c in contexts))
    return "\n".join(lines)


def _heatmap(scores, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(0.5 * scores.shape[1] + 2.5, 0.18 * scores.shape[0] + 1.5))
    image = ax.imshow(scores.numpy(), cmap="viridis", vmin=0, vmax=1, aspect="auto")
    ax.set_xlabel("kv head")
    ax.set_ylabel("layer")
    ax.set_title("retrieval score")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
