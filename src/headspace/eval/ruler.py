"""Synthetic long-context tasks in the spirit of RULER: seeded, deterministic, scored by
string match. Each case has answers (all must appear) and distractors (none may count)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery",
         "variable_tracking", "common_words", "frequent_words")  # fmt: skip
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass(frozen=True)
class RulerCase:
    task: str
    text: str  # the prompt text (before any chat template)
    answers: tuple[str, ...]
    distractors: tuple[str, ...]

    def score(self, generation: str) -> float:
        """Fraction of the answers found in the generation (RULER's string match)."""
        found = [a.lower() in generation.lower() for a in self.answers]
        return sum(found) / len(found)


def _word(rng: random.Random, length: int = 6) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length))


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _fill(pieces: list[str], filler: str, num_words: int, rng: random.Random) -> str:
    """Scatter ``pieces`` at random sentence boundaries of ``num_words`` filler words."""
    words = (filler.split() * (num_words // max(len(filler.split()), 1) + 1))[:num_words]
    cuts = sorted(rng.randrange(len(words) + 1) for _ in pieces)
    out, last = [], 0
    for cut, piece in zip(cuts, pieces, strict=True):
        out += [*words[last:cut], piece]
        last = cut
    return " ".join(out + words[last:])


def _niah(task: str, rng: random.Random, filler: str, num_words: int) -> RulerCase:
    num_keys = {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": 1, "niah_multiquery": 4}
    keys = [f"{_word(rng)}-{_word(rng, 5)}" for _ in range(num_keys[task])]
    values = {k: [_number(rng) for _ in range(4 if task == "niah_multivalue" else 1)] for k in keys}
    asked = keys[:2] if task == "niah_multiquery" else keys[:1]
    needles = [
        f"One of the special magic numbers for {k} is: {v}." for k in keys for v in values[k]
    ]
    rng.shuffle(needles)
    haystack = _fill(needles, filler, num_words, rng)
    question = (f"What are all the special magic numbers for {' and '.join(asked)} mentioned in "
                "the text above? Answer with the numbers only.")  # fmt: skip
    answers = tuple(v for k in asked for v in values[k])
    others = tuple(v for k in keys if k not in asked for v in values[k]) or (_number(rng),)
    return RulerCase(task, f"{haystack}\n\n{question}", answers, others)


def _variable_tracking(rng: random.Random, filler: str, num_words: int) -> RulerCase:
    value, other = _number(rng)[:5], _number(rng)[:5]
    chains = [[_word(rng, 5).upper() for _ in range(4)] for _ in range(2)]
    statements = []
    for chain, start in zip(chains, (value, other), strict=True):
        statements.append(f"VAR {chain[0]} = {start}.")
        statements += [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:], strict=False)]
    text = _fill(statements, NOISE, num_words, rng)  # statements keep their order below
    ordered = " ".join(statements)
    text = text if all(s in text for s in statements) else text + " " + ordered
    question = f"Find all variables that are assigned the value {value} in the text above."
    return RulerCase("variable_tracking", f"{text}\n\n{question}", tuple(chains[0]),
                     tuple(chains[1]))  # fmt: skip


def _word_counts(task: str, rng: random.Random, num_words: int) -> RulerCase:
    vocab = [_word(rng, 5) for _ in range(max(num_words // 8, 40))]
    if task == "common_words":  # common words 4-30 times (fewer in short lists), rare ones
        common, rare = vocab[:10], vocab[10:]  # at most a third as often
        repeats = min(max(num_words // 25, 4), 30)
        counts = {w: repeats for w in common} | {w: max(1, repeats // 10) for w in rare}
        top, label = common, "10 most common words"
    else:  # frequent_words: Zipf-like frequencies (the first 12-60 times, fewer in short
        # lists), the three most frequent asked
        first = min(max(num_words // 12, 12), 60)
        counts = {w: max(1, int(first / (rank + 1))) for rank, w in enumerate(vocab)}
        top, label = vocab[:3], "3 most frequently appearing words"
    words = [w for w, n in counts.items() for _ in range(n)]
    rng.shuffle(words)
    words = words[: max(num_words, sum(counts[w] for w in top))]
    listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
    question = f"What are the {label} in the list above? Answer with the words only."
    rare_words = tuple(w for w in vocab[-5:] if w not in top)
    return RulerCase(task, f"{listing}\n\n{question}", tuple(top), rare_words)


def make_case(task: str, length_words: int, seed: int, filler: str) -> RulerCase:
    """One case of ``task`` with about ``length_words`` words of context, from ``seed``."""
    rng = random.Random(f"{task}:{length_words}:{seed}")
    makers: dict[str, Callable[[], RulerCase]] = {
        "variable_tracking": lambda: _variable_tracking(rng, filler, length_words),
        "common_words": lambda: _word_counts(task, rng, length_words),
        "frequent_words": lambda: _word_counts(task, rng, length_words),
    }
    return makers.get(task, lambda: _niah(task, rng, filler, length_words))()
