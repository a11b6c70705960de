"""``headspace eval niah|ruler|ppl``: long-context evaluations with tables, CSV and plots."""

from __future__ import annotations

import sys
from pathlib import Path

from headspace.cli.commands import COMMAND_HELP
from headspace.cli.options import add_engine_parallel_options
from headspace.errors import UserError

# ppl's defaults by device: a CPU run of two modes over the two built-in texts finishes in
# minutes (whole texts at 2K and 8K would take hours there)
GPU_CONTEXTS, CPU_CONTEXTS, CPU_MAX_TOKENS = "2k,8k", "1k,2k", 2048


def _list(text: str, parse=str) -> list:
    return [parse(x) for x in text.split(",") if x.strip()]


def add_eval_parser(subparsers, add_engine_options) -> None:
    from headspace.cli.plan import parse_tokens
    from headspace.eval.ruler import TASKS

    p = subparsers.add_parser("eval", help=COMMAND_HELP["eval"])
    p.add_argument("suite", choices=["niah", "ruler", "ppl"])
    p.add_argument("--model", help="checkpoint directory or .gguf file (default: embedded model)")
    p.add_argument("--lengths", default="1k,2k,4k,8k", help="prompt lengths (niah, ruler)")
    p.add_argument("--depths", default="0,25,50,75,100", help="needle depths in percent")
    p.add_argument("--tasks", default=",".join(TASKS), help="RULER tasks")
    p.add_argument("--samples", type=int, default=1, help="RULER cases per task and length")
    p.add_argument(
        "--text", default="alice29,plrabn12", help="texts for ppl: built-in names or files"
    )
    p.add_argument("--context", default=None,
                   help=f"perplexity windows (default: {GPU_CONTEXTS} on a GPU, {CPU_CONTEXTS} "
                   f"on the CPU)")  # fmt: skip
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="ppl: read at most this many tokens of each text, then cut into windows "
        f"(default: all on a GPU, {CPU_MAX_TOKENS:,} on the CPU)",
    )
    p.add_argument(
        "--decode-tokens", type=int, default=0,
        help="ppl: score each window's last N tokens through decode steps (teacher forcing), "
        "which run the decode tiers (hybrid, sparse); windows then advance by N",
    )  # fmt: skip
    p.add_argument("--needle", default=None, help="the needle sentence (with --question, --answer)")
    p.add_argument("--question", default=None)
    p.add_argument("--answer", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="eval_results", help="folder for CSV and PNG files")
    p.add_argument(
        "--compare", nargs="+", default=None, metavar="OFFLOAD",
        help="one run per mode: an offload mode (none: all resident), hybrid-sparse[:BETA] "
        "(hybrid with cpu_sparsity BETA, default --cpu-sparsity or 1), POLICY:BUDGET (a KV "
        "budget, e.g. ada_snapkv:0.25) or streaming:SHARE (the --profile's SHARE of heads "
        "keep every token, the others --sparse-pattern); flags differences",
    )  # fmt: skip
    add_engine_options(p)
    add_engine_parallel_options(p)
    p.set_defaults(parse_tokens=parse_tokens)


def _rows(args, llm, modes_left: int = 1) -> tuple[list[dict], list[str], list[str]]:
    """(rows, key columns, value columns) of the chosen suite (``modes_left``: this mode and
    those a comparison runs after it, which ppl's estimate covers)."""
    from headspace.eval import run
    from headspace.eval.niah import Needle

    lengths = _list(args.lengths, args.parse_tokens)
    if args.suite == "niah":
        parts = (args.needle, args.question, args.answer)
        if any(parts) and not all(parts):
            raise UserError("--needle, --question and --answer go together")
        needle = Needle(f" {args.needle}", args.question, args.answer) if all(parts) else None
        rows = run.run_niah(llm, lengths, _list(args.depths, float), needle)
        return rows, ["length", "depth"], ["score", "prompt_tokens"]
    if args.suite == "ruler":
        rows = run.run_ruler(llm, lengths, _list(args.tasks), args.seed, args.samples)
        return rows, ["task", "length", "sample"], ["score", "prompt_tokens"]
    rows = run.run_ppl(llm, _list(args.text), _list(args.context, args.parse_tokens),
                       args.max_tokens, args.decode_tokens, report=_say,
                       modes=modes_left)  # fmt: skip
    return rows, ["text", "context"], ["perplexity", "tokens"]


def _mode_options(mode: str, options: dict) -> dict:
    """Engine options of one ``--compare`` mode: an offload mode, ``hybrid-sparse[:BETA]``
    (the hybrid tier with ``cpu_sparsity``), ``POLICY:BUDGET`` (a KV budget, e.g.
    ``ada_snapkv:0.25``) or ``PATTERN:SHARE`` (``retrieval_heads``, the others taking that
    kind of pattern: ``--sparse-pattern`` if it is of the kind, else the kind's default);
    other modes run exact (no sparsity, no budget, no patterns)."""
    from headspace.engine.config import KV_POLICIES
    from headspace.kv.spec import DEFAULT_PATTERNS, Pattern

    name, _, value = mode.partition(":")
    exact = {**options, "cpu_sparsity": None, "kv_budget": None, "retrieval_heads": None}
    if name in KV_POLICIES:
        budget = _budget(value, mode)
        return {**exact, "offload": "none", "kv_policy": name, "kv_budget": budget}
    if name in DEFAULT_PATTERNS:
        share = _number(value, mode, "the share of retrieval heads")
        given = options.get("sparse_pattern") or DEFAULT_PATTERNS[name]
        try:
            kind = Pattern.parse(given).kind
        except ValueError as error:
            raise UserError(f"--sparse-pattern: {error}") from None
        pattern = given if kind == name else DEFAULT_PATTERNS[name]
        offload = "none" if name == "streaming" else options["offload"]
        return {**exact, "offload": offload, "retrieval_heads": share, "sparse_pattern": pattern}
    if name != "hybrid-sparse":
        if value:
            raise UserError(f"only hybrid-sparse, the patterns and the KV policies take a "
                            f"value after ':', got {mode!r}")  # fmt: skip
        return {**exact, "offload": name}
    beta = _number(value, mode, "BETA") if value else (options.get("cpu_sparsity") or 1.0)
    return {**exact, "offload": "hybrid", "cpu_sparsity": beta, "cpu_share": None}


def _budget(text: str, mode: str) -> float | int:
    """The budget of a ``POLICY:BUDGET`` mode, read as ``--kv-budget`` reads it."""
    import argparse

    from headspace.cli.options import kv_budget_value

    try:
        return kv_budget_value(text)
    except argparse.ArgumentTypeError as error:
        raise UserError(f"{mode!r}: {error}") from None


def _number(text: str, mode: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UserError(f"{mode!r}: {what} after ':' must be a number") from None


DECODE_SCORED = 256  # ppl: tokens a window scores by decode steps where a mode acts there


def _acts_at_decode(options: dict) -> bool:
    """Whether a mode changes decode, not the prompt's prefill: KV budgets (compression
    follows the prompt), sparse hybrid attention, streaming heads (sink and window only)."""
    streaming = options.get("retrieval_heads") is not None and str(
        options.get("sparse_pattern", "")).startswith("streaming")  # fmt: skip
    return options.get("kv_budget") is not None or options.get("cpu_sparsity") is not None \
        or streaming  # fmt: skip


def _decode_scoring(args, mode_options: list[dict]) -> None:
    """Perplexity scored where approximate modes act: without ``--decode-tokens`` every
    token is scored at prefill, before any compression, so such a mode would read as
    exact. Then each window's last ``DECODE_SCORED`` tokens go through decode steps, for
    every mode alike (said on stderr)."""
    if args.suite != "ppl" or args.decode_tokens or not any(map(_acts_at_decode, mode_options)):
        return
    args.decode_tokens = DECODE_SCORED
    print(f"ppl: budgets, sparse hybrid attention and streaming heads act at decode; each "
          f"window's last {DECODE_SCORED} tokens are scored through decode steps "
          f"(--decode-tokens sets it)", file=sys.stderr)  # fmt: skip


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def _ppl_defaults(args, options: dict) -> str | None:
    """ppl's windows and text length where not given, by device; the line that says the
    CPU's shorter texts (for stderr, once the options are checked)."""
    if args.suite != "ppl":
        return None
    on_gpu = str(options.get("device") or "cpu").startswith("cuda")
    if args.context is None:
        args.context = GPU_CONTEXTS if on_gpu else CPU_CONTEXTS
    if args.max_tokens is not None or on_gpu:
        return None
    args.max_tokens = CPU_MAX_TOKENS
    return (f"ppl on the CPU: each text's first {CPU_MAX_TOKENS:,} tokens at contexts "
            f"{args.context} (--max-tokens and --context set them)")  # fmt: skip


def _check_counts(args) -> None:
    """One-line errors for counts that would score nothing."""
    lengths = args.context if args.suite == "ppl" else args.lengths
    if any(n < 2 for n in _list(lengths, args.parse_tokens)):
        flag = "--context" if args.suite == "ppl" else "--lengths"
        raise UserError(f"{flag}: every length must be at least 2 tokens, got {lengths!r}")
    for flag, value, least in (("--samples", args.samples, 1), ("--max-tokens", args.max_tokens, 2),
                               ("--decode-tokens", args.decode_tokens, 0)):  # fmt: skip
        if value is not None and value < least:
            raise UserError(f"{flag} must be at least {least}, got {value}")


def _check_modes(mode_options: list[dict]) -> None:
    """Each ``--compare`` mode's engine options, checked before the first mode runs (a bad
    one would otherwise be refused only after the others' runs)."""
    from headspace.engine.config import EngineConfig
    from headspace.parallel.config import ENGINE_FIELDS

    for options in mode_options:
        EngineConfig.of(**{k: v for k, v in options.items() if k not in ENGINE_FIELDS})


def _keep_partial(rows: list[dict], path: Path) -> None:
    """After Ctrl-C: the rows finished so far into ``path``, said on stderr."""
    from headspace.eval import run

    if not rows:
        _say("interrupted before any row finished: nothing written")
        return
    run.write_csv(rows, path)
    _say(f"interrupted: the {len(rows)} rows finished are in {path}")


def run_eval(args, options: dict) -> None:
    from headspace.api import LLM
    from headspace.eval import run
    from headspace.parallel.launch import is_first_rank

    defaults = _ppl_defaults(args, options)
    _check_counts(args)
    modes = args.compare or [options["offload"]]
    per_mode = [_mode_options(m, options) if args.compare else options for m in modes]
    if args.compare:
        _check_modes(per_mode)
    if defaults is not None:
        _say(defaults)
    _decode_scoring(args, per_mode)
    results = {}
    for index, (mode, mode_options) in enumerate(zip(modes, per_mode, strict=True)):
        if args.compare and mode == "none":  # the all-resident reference ignores the budget
            mode_options["gpu_memory"] = None
        llm = LLM(args.model, **mode_options)
        suffix = f"_{mode.replace(':', '-')}" if args.compare else ""  # each mode as it ends
        out = Path(args.output)
        try:
            rows, keys, values = _rows(args, llm, len(modes) - index)
        except run.EvalInterrupted as stopped:
            _keep_partial(stopped.rows, out / f"{args.suite}{suffix}_partial.csv")
            raise
        results[mode] = rows
        if not is_first_rank():  # under torchrun, rank 0 writes the files
            continue
        run.write_csv(rows, out / f"{args.suite}{suffix}.csv")
        written = [out / f"{args.suite}{suffix}.csv"]
        if args.suite == "niah":
            run.niah_heatmap(rows, out / f"niah{suffix}.png", f"needle in a haystack ({mode})")
            written.append(out / f"niah{suffix}.png")
        print(f"wrote {', '.join(map(str, written))}", file=sys.stderr)
    if not args.compare:
        rows = results[modes[0]]
        if args.suite == "ruler":  # per-task accuracy; the CSV keeps every case
            summary = run.accuracy_by(rows, ["task", "length"])
            print(run.table(summary, ["task", "length", "accuracy", "cases"]))
            return
        print(run.table(rows, keys + values))
        return
    merged = []
    for rows in zip(*results.values(), strict=True):
        row = {k: rows[0][k] for k in keys}
        row |= {f"{values[0]}[{m}]": r[values[0]] for m, r in zip(modes, rows, strict=True)}
        if "tokens" in rows[0]:  # what each figure rests on (every mode scores the same)
            row["tokens"] = rows[0]["tokens"]
        if args.suite == "ppl":  # relative to the first mode's
            row |= {f"delta[{m}]": f"{r[values[0]] / rows[0][values[0]] - 1:+.2%}"
                    for m, r in zip(modes[1:], rows[1:], strict=True)}  # fmt: skip
        row["differs"] = "DIFFERS" if len({r[values[0]] for r in rows}) > 1 else ""
        merged.append(row)
    print(run.table(merged, list(merged[0])))
