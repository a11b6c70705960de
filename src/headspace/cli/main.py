"""``headspace`` command line: parsing and formatting only; the work is in the API."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from headspace.cli.commands import COMMAND_HELP
from headspace.errors import UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other user error
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _add_generate(subparsers) -> None:
    from headspace.cli.options import add_engine_options, add_engine_parallel_options

    p = subparsers.add_parser("generate", help=COMMAND_HELP["generate"])
    p.add_argument("--model", help="checkpoint directory or .gguf file (default: embedded model)")
    p.add_argument("--prompt", help="prompt text (appended after --prompt-file if both given)")
    p.add_argument("--prompt-file", help="read the prompt (e.g. a document) from this file")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="skip the request run first, in the prompt's shapes, to compile "
                   "and capture graphs (then counted in the prompt's prefill)")  # fmt: skip
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--max-new-tokens", type=int, default=256,
                          help="most tokens generated (default: 256)")  # fmt: skip
    sampling.add_argument("--temperature", type=float, default=0.0,
                          help="0 = greedy (default: 0)")  # fmt: skip
    sampling.add_argument("--top-p", type=float, default=1.0,
                          help="nucleus sampling: the smallest set of tokens whose "
                          "probabilities reach this (default: 1, all)")  # fmt: skip
    sampling.add_argument(
        "--top-k", type=int, default=0, help="sample among the k likeliest tokens (default: 0, all)"
    )
    sampling.add_argument(
        "--seed", type=int, default=None, help="seed of the sampler (default: none, a fresh one)"
    )
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    for flag, default, kind, text in PENALTY_FLAGS:
        sampling.add_argument(flag, type=kind, default=default, help=text)
    add_engine_options(p)
    add_engine_parallel_options(p)


PENALTY_FLAGS = (  # (flag, default, type, help): SamplingParams' fields of the same names
    ("--repetition-penalty", 1.0, float, "over the prompt and generated tokens, in [0.01, 100] "
     "(default: 1, off)"),
    ("--presence-penalty", 0.0, float, "over the generated tokens, in [-2, 2] (default: 0)"),
    ("--frequency-penalty", 0.0, float, "per occurrence in the generated tokens, in [-2, 2] "
     "(default: 0)"),
    ("--min-tokens", 0, int, "no end-of-sequence or stop token before this many (default: 0)"),
)  # fmt: skip


def build_parser(options: bool = True) -> argparse.ArgumentParser:
    """The command line's parser; without ``options``, its subcommands' names and help only
    (``--help`` and ``--version``, answered without importing torch)."""
    from headspace import __version__

    parser = _Parser(prog="headspace", description="Long-context LLM inference.")
    parser.add_argument("--version", action="version", version=f"headspace {__version__}")
    subparsers = parser.add_subparsers(dest="command", parser_class=_Parser)
    if not options:
        for name, text in COMMAND_HELP.items():
            subparsers.add_parser(name, help=text)
        return parser
    from headspace.cli.eval import add_eval_parser
    from headspace.cli.options import add_engine_options
    from headspace.cli.plan import add_plan_parser
    from headspace.cli.profile import add_profile_parser
    from headspace.cli.serve import add_serve_parser

    _add_generate(subparsers)
    add_plan_parser(subparsers)
    add_eval_parser(subparsers, add_engine_options)
    add_profile_parser(subparsers, add_engine_options)
    add_serve_parser(subparsers)
    return parser


def _read_prompt(args) -> str:
    parts = []
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as handle:
                parts.append(handle.read())
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read prompt file {args.prompt_file}: {exc}") from None
    if args.prompt is not None:
        parts.append(args.prompt)
    if not parts and not sys.stdin.isatty():
        parts.append(sys.stdin.read())
    if not parts:
        raise UserError("no prompt: pass --prompt, --prompt-file or text on stdin")
    return "\n\n".join(part.strip("\n") for part in parts)


def _generate(args) -> None:
    from headspace.api import LLM
    from headspace.engine.engine import compile_in_process
    from headspace.engine.sampling import SamplingParams
    from headspace.model.compile_meter import COMPILE_METER

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        **{flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
           for flag, *_ in PENALTY_FLAGS},
    )  # fmt: skip
    from headspace.cli.options import engine_options

    prompt = _read_prompt(args)
    started = time.perf_counter()
    options = engine_options(args)
    on_gpu = str(options.get("device", "cpu")).startswith("cuda")
    if on_gpu:  # torch.compile runs on GPUs
        compile_in_process()  # one request: no pool of compile workers to start and stop
    llm = LLM(args.model, **options)
    load_seconds = time.perf_counter() - started
    prompt_ids = llm.engine.encode(prompt, chat=args.chat)
    llm.engine.check_request(prompt_ids, params)  # bad input refused before the warm-up
    _note_past_trained_context(len(prompt_ids) + params.max_new_tokens - 1,
                               llm.engine.model.config.max_context)  # fmt: skip
    # after the check, so that an error stays the one line on stderr
    weights = sum(p.nbytes for p in llm.engine.model.parameters())
    print(f"load {load_seconds:.1f} s ({weights / 1e9:.2f} GB of weights read in "
          f"{llm.engine.load_seconds:.1f} s)", file=sys.stderr)  # fmt: skip
    compiled = COMPILE_METER.seconds
    if args.warm_up:  # on its own line: the summary's prefill is the prompt's alone
        alone = len(prompt_ids) + params.max_new_tokens  # (offloaded: laid out as it)
        seconds = llm.engine.warm_up(len(prompt_ids), decode=params.max_new_tokens > 1,
                                     offload=True, alone=alone)  # fmt: skip
        what = "a first request, no compilation"
        if on_gpu:
            what = f"{COMPILE_METER.seconds - compiled:.1f} s compiling, graph capture"
        print(f"warm-up {seconds:.1f} s ({what})", file=sys.stderr)
    compiled = COMPILE_METER.seconds
    pieces = 0
    try:
        for piece in llm.stream(prompt_ids, params):
            sys.stdout.write(piece)
            sys.stdout.flush()
            pieces += 1
    except KeyboardInterrupt:  # the partial text stays; its request was aborted
        sys.stdout.write("\n")
        partial = llm.last_output  # (None when interrupted before the first step ended)
        print(f"interrupted after {pieces} pieces of text" if partial is None
              else partial.stats.summary(), file=sys.stderr)  # fmt: skip
        raise
    sys.stdout.write("\n")
    stats = llm.last_output.stats
    print(stats.summary(), file=sys.stderr)
    notes = summary_notes(stats, llm.engine.config.offload.mode, llm.engine.config.entry_budget())
    notes += compile_notes(COMPILE_METER.seconds - compiled)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)


ALMOST_ALL_KV = 0.9  # a KV budget keeping this share of the full KV or more saves little


def summary_notes(stats, offload_mode: str, budget=None) -> list[str]:
    """What the summary's figures mean for the options asked: an offload mode the request
    did not need; a KV budget (``budget``, a :class:`~headspace.budgets.KVBudget`; None:
    none) on a prompt too short for it, one its observation window raised past its share,
    or one keeping almost everything."""
    from headspace.budgets import WINDOW

    notes = []
    prompt = stats.prompt_tokens
    if budget is not None and isinstance(budget.value, float) and prompt > WINDOW and \
            budget.tokens(prompt) > round(budget.value * prompt):  # fmt: skip
        kept = budget.tokens(prompt)
        notes.append(f"the KV budget keeps {kept} of the prompt's {prompt} tokens a head "
                     f"({kept / prompt:.0%}), not the {budget.value:.0%} asked: every policy "
                     f"keeps its {budget.window}-token observation window, so a {budget.value:.0%} "
                     f"budget needs a prompt of {math.ceil(budget.window / budget.value)} tokens "
                     f"or more")  # fmt: skip
    if offload_mode in ("layer", "head", "hybrid") and not stats.num_streamed_heads + \
            stats.num_hybrid_heads:  # fmt: skip
        notes.append(f"--offload {offload_mode} was not needed: the request's KV fit the GPU "
                     f"budget, so every head stayed resident")  # fmt: skip
    if stats.kv_held_fraction is not None:
        if stats.prompt_tokens <= WINDOW:
            notes.append(f"the prompt ({stats.prompt_tokens} tokens) is within the KV "
                         f"budget's {WINDOW}-token observation window, which is always kept: "
                         f"budgets are for long prompts")  # fmt: skip
        elif stats.kv_held_fraction >= ALMOST_ALL_KV:
            notes.append(f"the KV budget kept {stats.kv_held_fraction:.0%} of the full KV: "
                         f"it saves little here, and the tokens it dropped may still change "
                         f"the output")  # fmt: skip
    return notes


COMPILE_NOTE_S = 0.05  # compiling during the request worth a note (seconds)


def compile_notes(seconds: float) -> list[str]:
    """A note when the request itself compiled (shapes the warm-up did not meet: a later
    prefix length, another layout): its figures include that time."""
    if seconds < COMPILE_NOTE_S:
        return []
    return [f"{seconds:.1f} s of this request went to compiling shapes the warm-up did not "
            f"meet; its prefill and decode figures include them"]  # fmt: skip


def _note_past_trained_context(most_tokens: int, trained: int) -> None:
    """A note on stderr when a request may run past the model's trained context (allowed
    with --max-context): ``plan`` says the same. ``most_tokens``: the positions it may run
    (its last new token is predicted, never run)."""
    if most_tokens > trained:
        print(f"note: this request may reach {most_tokens:,} tokens, past the model's trained "
              f"context of {trained:,}: what it generates there is outside its training",
              file=sys.stderr)  # fmt: skip


def _command(name: str):
    """The function that runs subcommand ``name``, given its parsed arguments."""
    if name == "plan":
        from headspace.cli.plan import run_plan as run
    elif name == "eval":
        from headspace.cli.eval import run_eval
        from headspace.cli.options import engine_options

        def run(args):
            return run_eval(args, engine_options(args))
    elif name == "profile":
        from headspace.cli.profile import run_profile as run
    elif name == "serve":
        from headspace.cli.serve import run_serve as run
    else:
        run = _generate
    return run


# how long a quiet rank waits before it exits with a one-line error, so that rank 0 (which
# meets the same error) prints it before torchrun stops every rank at the first exit
QUIET_RANK_GRACE_S = 5.0


def _quiet_other_ranks() -> bool:
    """Under torchrun only rank 0 writes (the output, progress bars, one-line errors); the
    others keep stderr for tracebacks only. Returns whether this rank is quiet."""
    from headspace.parallel.launch import is_first_rank

    if is_first_rank():
        return False
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (kept for the process)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "--version"):  # (no torch imported)
        parser = build_parser(options=False)
        parser.parse_args(argv)  # --help and --version print and exit 0
        parser.print_help()  # no command
        return 2
    from headspace.cli.options import join_negative_values

    parser = build_parser()
    quiet = _quiet_other_ranks()
    try:
        args = parser.parse_args(join_negative_values(argv))
        _command(args.command)(args)
    except UserError as exc:
        print("error: " + " ".join(str(exc).split()), file=sys.stderr)  # always one line
        if quiet:  # the same error on rank 0 is the one said: let it say it first (torchrun
            time.sleep(QUIET_RANK_GRACE_S)  # stops the others once one rank exits)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except MemoryError:
        print("error: out of memory: lower --prefill-chunk or the context", file=sys.stderr)
        return 2
    except BaseException:
        if quiet:  # a bug on another rank: its traceback still shows
            sys.stderr = sys.__stderr__
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
