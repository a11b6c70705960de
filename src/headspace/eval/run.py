"""Evaluation drivers over an ``LLM``: rows of results, CSV files, tables and heatmaps."""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

from tqdm import tqdm

from headspace.engine.sampling import SamplingParams
from headspace.errors import UserError
from headspace.eval.data import builtin_text, haystack_text
from headspace.eval.niah import Needle, build_case, score
from headspace.eval.ppl import sliding_window_nll
from headspace.eval.ruler import make_case

WORDS_PER_TOKEN = 0.7  # English prose, roughly: a RULER case's first try (then fitted in tokens)


def _encoder(llm, chat: bool):
    return lambda text: llm.engine.encode(text, chat=chat)


def run_niah(llm, lengths: list[int], depths: list[float], needle: Needle | None = None,
             chat: bool = True, max_new_tokens: int = 32) -> list[dict]:  # fmt: skip
    """One row per (length, depth): the generation and its score, all run as one batch."""
    needle = needle or Needle()
    tokenizer = llm.engine.tokenizer
    haystack = tokenizer(haystack_text(), add_special_tokens=False)["input_ids"]
    cases = [build_case(tokenizer, _encoder(llm, chat), haystack, n, d, needle)
             for n in lengths for d in depths]  # fmt: skip
    params = SamplingParams(max_new_tokens=max_new_tokens)

    def row(position: int, output) -> dict:
        case = cases[position]
        return {"length": case.length, "depth": case.depth,
                "prompt_tokens": len(case.prompt_ids), "score": score(needle.answer, output.text),
                "generation": output.text.strip()}  # fmt: skip

    return _generate(llm, [c.prompt_ids for c in cases], params, row)


def run_ruler(llm, lengths: list[int], tasks: list[str], seed: int = 0, samples: int = 1,
              chat: bool = True, max_new_tokens: int = 48) -> list[dict]:  # fmt: skip
    """One row per (task, length, sample) with its score."""
    filler = haystack_text()
    fitted = [(task, n, s, *_fitted_case(llm, task, n, seed + s, filler, chat))
              for task in tasks for n in lengths for s in range(samples)]  # fmt: skip
    prompts = [prompt for *_, prompt in fitted]

    def row(position: int, output) -> dict:
        task, n, s, case, prompt = fitted[position]
        return {"task": task, "length": n, "sample": s, "prompt_tokens": len(prompt),
                "score": case.score(output.text), "generation": output.text.strip()}  # fmt: skip

    return _generate(llm, prompts, SamplingParams(max_new_tokens=max_new_tokens), row)


def _fitted_case(llm, task: str, length: int, seed: int, filler: str, chat: bool):
    """``(case, prompt ids)`` of at most ``length`` tokens and, where a few tries reach it,
    at least 95% of it: words per token differ by task (a numbered word list takes several
    tokens a word), so the word count is scaled by the tokens each try took (as RULER sizes
    its haystacks to the tokenizer). UserError when no try fits."""
    num_words, best = int(length * WORDS_PER_TOKEN), None
    for _ in range(6):
        case = make_case(task, num_words, seed, filler)
        prompt = llm.engine.encode(case.text, chat=chat)
        if len(prompt) <= length and (best is None or len(prompt) > len(best[1])):
            best = case, prompt
        if 0.95 * length <= len(prompt) <= length:
            break
        num_words = max(1, int(num_words * 0.98 * length / len(prompt)))
    if best is None:
        raise UserError(f"a {task} case does not fit {length} tokens; use a longer length")
    return best


def _generate(llm, prompts: list[list[int]], params: SamplingParams, row) -> list[dict]:
    """Batched generation with a progress bar over finished requests: ``row(position,
    output)`` of each prompt, in order. Ctrl-C raises :class:`EvalInterrupted` with the
    rows of the requests finished before it."""
    rows: dict[int, dict] = {}

    def keep(position: int, output) -> None:
        rows[position] = row(position, output)

    try:
        llm.generate(prompts, params, use_tqdm=True, on_finish=keep)
    except KeyboardInterrupt:
        raise EvalInterrupted([rows[i] for i in sorted(rows)]) from None
    return [rows[i] for i in range(len(prompts))]


class EvalInterrupted(KeyboardInterrupt):
    """Ctrl-C during an evaluation: ``rows``, the results finished before it."""

    def __init__(self, rows: list[dict]):
        super().__init__()
        self.rows = rows


def ppl_windows(num_tokens: int, context: int, decode_tokens: int = 0) -> int:
    """Windows a sliding-window perplexity over ``num_tokens`` tokens runs at ``context``
    (advancing by half a window, or by ``decode_tokens``)."""
    stride = decode_tokens or context // 2
    return max(1, math.ceil((num_tokens - context) / stride) + 1)


def run_ppl(llm, texts: list[str], contexts: list[int], max_tokens: int | None = None,
            decode_tokens: int = 0, report=None, modes: int = 1) -> list[dict]:  # fmt: skip
    """Sliding-window perplexity per (text, context). With ``decode_tokens``, each window's
    last ``decode_tokens`` tokens are scored, predicted by decode steps (teacher forcing):
    the path generation takes, with its tiers. ``report(line)``: the run's windows up
    front and, after the first, the time they should take (in each of ``modes`` modes, a
    comparison's). Ctrl-C raises :class:`EvalInterrupted` with the rows finished."""
    token_ids = {name: llm.engine.tokenizer(builtin_text(name))["input_ids"][:max_tokens]
                 for name in texts}  # fmt: skip
    # (windows, tokens each) of each text at each context
    sizes = [(ppl_windows(len(ids), c, decode_tokens), min(c, len(ids)))
             for ids in token_ids.values() for c in contexts]  # fmt: skip
    clock = _WindowClock(sum(n for n, _ in sizes), sum(n * size for n, size in sizes), report,
                         modes)  # fmt: skip
    rows = []
    try:
        for name, ids in token_ids.items():
            for context in contexts:
                rows.append(_ppl_row(llm, name, ids, context, decode_tokens, clock))
    except KeyboardInterrupt:
        raise EvalInterrupted(rows) from None
    return rows


class _WindowClock:
    """Counts a run's windows; after the first, reports how long all should take: the
    first's seconds a token times the tokens of every window (``total_tokens``), of each
    of ``modes`` modes a comparison runs."""

    def __init__(self, total: int, total_tokens: int, report=None, modes: int = 1):
        self.total, self.total_tokens, self.report, self.done = total, total_tokens, report, 0
        self.modes = modes
        self.started = time.perf_counter()
        if report is not None:
            each = f" in each of {modes} modes" if modes > 1 else ""
            report(f"ppl: {total:,} windows to score{each}")

    def tick(self, tokens: int) -> None:
        """A window of ``tokens`` tokens scored."""
        self.done += 1
        if self.done == 1 and self.report is not None:
            seconds = time.perf_counter() - self.started
            whole = seconds / tokens * self.total_tokens * self.modes
            every = f" in {self.modes} modes" if self.modes > 1 else ""
            self.report(f"ppl: the first window took {seconds:.1f} s: about "
                        f"{_duration(whole)} for all {self.total:,}{every} (Ctrl-C "
                        f"keeps the rows finished)")  # fmt: skip


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _ppl_row(llm, name: str, ids: list[int], context: int, decode_tokens: int,
             clock: _WindowClock) -> dict:  # fmt: skip
    """Perplexity of one text at one context."""

    def logits(window: list[int]):  # (the last window may be shorter)
        steps = min(decode_tokens + 1, len(window) - 1) if decode_tokens else 0
        scored = llm.logits(window, decode_tokens=steps)
        clock.tick(len(window))
        return scored

    windows = ppl_windows(len(ids), context, decode_tokens)
    with tqdm(total=windows, desc=f"ppl {name} @{context}", unit="window") as bar:

        def on_window() -> None:
            bar.update()

        nll, count = sliding_window_nll(logits, ids, context, on_window=on_window,
                                        score_last=decode_tokens or None)  # fmt: skip
    if count == 0:
        raise UserError(f"{name}: no token to score at context {context} "
                        f"({len(ids)} tokens read)")  # fmt: skip
    return {"text": Path(name).stem, "context": context, "tokens": count,
            "perplexity": math.exp(nll / count)}  # fmt: skip


def accuracy_by(rows: list[dict], keys: list[str]) -> list[dict]:
    """Mean score per distinct value of ``keys`` (e.g. per task and length), with counts."""
    groups: dict[tuple, list[float]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row["score"])
    return [{**dict(zip(keys, key, strict=True)), "accuracy": sum(v) / len(v), "cases": len(v)}
            for key, v in groups.items()]  # fmt: skip


def write_csv(rows: list[dict], path: Path) -> None:
    if not rows:
        raise UserError(f"nothing to write to {path}: no case ran")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def table(rows: list[dict], columns: list[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(_fmt(r[c]).rjust(w) for c, w in zip(columns, widths, strict=True))
              for r in rows]  # fmt: skip
    return "\n".join(lines)


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def niah_heatmap(rows: list[dict], path: Path, title: str) -> None:
    """Depth x length heatmap of the scores (green = found)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    grid = [[next(r["score"] for r in rows if r["length"] == n and r["depth"] == d)
             for n in lengths] for d in depths]  # fmt: skip
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2, 0.6 * len(depths) + 1.5))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(
        range(len(lengths)), [f"{round(n / 1024)}K" if n >= 1024 else str(n) for n in lengths]
    )
    ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="score")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
