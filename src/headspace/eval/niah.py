"""Needle in a haystack (Kamradt style): a fact hidden at a depth of a long real text."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Needle:
    """The hidden fact, the question about it, and the answer the scorer looks for."""

    text: str = (
        " The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a "
        "sunny day."
    )
    question: str = "What is the best thing to do in San Francisco?"
    answer: str = "Dolores Park"


@dataclass(frozen=True)
class NiahCase:
    length: int  # target prompt length in tokens
    depth: float  # requested percent of the context before the needle
    prompt_ids: list[int]
    needle_at: int  # haystack tokens before the needle
    haystack_tokens: int  # haystack tokens in the prompt

    @property
    def actual_depth(self) -> float:
        return 100 * self.needle_at / self.haystack_tokens


def score(answer: str, generation: str) -> float:
    """1.0 when the needle's answer appears in the generation (case-insensitive), else 0.0."""
    return float(answer.lower() in generation.lower())


def _frame(encode, context_text: str, needle: Needle) -> str:
    return (f"Read the document and answer the question.\n\nDocument:\n{context_text}\n\n"
            f"Question: {needle.question} Answer in one short sentence.")  # fmt: skip


def build_case(tokenizer, encode, haystack_ids: list[int], length: int, depth: float,
               needle: Needle | None = None) -> NiahCase:  # fmt: skip
    """A prompt of about ``length`` tokens with the needle at ``depth`` percent of the text.

    ``encode(text) -> ids`` builds the final prompt (chat template or plain). The needle goes
    after a sentence end at most 1% of the text before the requested depth (the original
    test backs off to the previous sentence), else exactly at the depth.
    """
    needle = needle or Needle()
    overhead = len(encode(_frame(encode, "", needle)))
    needle_ids = tokenizer(needle.text, add_special_tokens=False)["input_ids"]
    budget = max(length - overhead - len(needle_ids), 16)
    repeats = -(-budget // len(haystack_ids))
    context = (haystack_ids * repeats)[:budget]
    target = int(round(budget * depth / 100))
    cut = target
    while cut > max(0, target - budget // 100) and cut < budget:
        if _decode(tokenizer, context[cut - 1 : cut]).rstrip().endswith("."):
            break
        cut -= 1
    else:
        cut = target
    text = _decode(tokenizer, context[:cut]) + needle.text + _decode(tokenizer, context[cut:])
    return NiahCase(length, depth, encode(_frame(encode, text, needle)), cut, budget)


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def count_occurrences(haystack: list[int], piece: list[int]) -> int:
    return sum(haystack[i : i + len(piece)] == piece for i in range(len(haystack) - len(piece) + 1))
