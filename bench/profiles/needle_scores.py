"""Where the observation-window scores (SnapKV's, what every budget policy ranks by) put a
needle's tokens, on the embedded model (CPU): for 4K NIAH prompts at a few depths, each
(layer, kv head)'s rank of the answer's first token and of the best token of the needle
sentence among the prompt's scored tokens, and how many heads would keep them at an even
share of a 0.25 budget.

    PYTHONPATH=src python bench/profiles/needle_scores.py [--length 4096] [--depths 10 50 90]

A rank near half the prompt is no better than chance: no policy that ranks by these scores
can keep that needle. Writes ``needle_scores_<model>_cpu.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
import headspace.tiers.budget as budget_executor  # noqa: E402
from common import write_result  # noqa: E402
from headspace.api import LLM  # noqa: E402
from headspace.budgets import POOL, WINDOW  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402
from headspace.eval.data import haystack_text  # noqa: E402
from headspace.eval.niah import Needle, build_case, score  # noqa: E402

SCORES: list[torch.Tensor] = []  # per layer [kv_heads, scored tokens] of the last prompt


def _record(kept_positions):
    def record(budget, scores, prompt_len, *args, **options):
        # the engine ranks the layers one call each, in order
        SCORES.extend(s.cpu().clone() for s in scores)
        return kept_positions(budget, scores, prompt_len, *args, **options)

    return record


def _find(ids: list[int], piece: list[int]) -> int:
    return next(i for i in range(len(ids)) if ids[i : i + len(piece)] == piece)


def _ranks(positions: range) -> torch.Tensor:
    """Best rank (0 = highest score) of ``positions`` in each (layer, kv head): ``[entries]``."""
    ranks = []
    for layer_scores in SCORES:
        order = layer_scores.argsort(dim=1, descending=True)
        rank = torch.empty_like(order).scatter_(
            1, order, torch.arange(order.shape[1]).expand_as(order)
        )
        ranks.append(rank[:, list(positions)].min(1).values)
    return torch.cat(ranks)


def measure(llm: LLM, length: int, depth: float) -> dict:
    tokenizer, needle = llm.tokenizer, Needle()
    haystack = tokenizer(haystack_text(), add_special_tokens=False)["input_ids"]
    case = build_case(tokenizer, lambda text: llm.engine.encode(text, chat=True), haystack,
                      length, depth, needle)  # fmt: skip
    ids = case.prompt_ids
    answer = _find(ids, tokenizer(" " + needle.answer, add_special_tokens=False)["input_ids"])
    sentence = tokenizer(needle.text, add_special_tokens=False)["input_ids"]
    first = _find(ids, sentence)
    SCORES.clear()
    output = llm.generate([ids], SamplingParams(max_new_tokens=32))[0].text
    scored = SCORES[0].shape[1]
    keep = int(0.25 * len(ids)) - WINDOW
    answer_ranks, needle_ranks = _ranks(range(answer, answer + 1)), _ranks(
        range(first, first + len(sentence)))  # fmt: skip
    return {"depth": depth, "prompt_tokens": len(ids), "scored_tokens": scored,
            "answer_position": answer, "found": score(needle.answer, output),
            "answer_rank_median": answer_ranks.median().item(),
            "heads_keeping_answer": int((answer_ranks < keep).sum()),
            "needle_best_rank_median": needle_ranks.median().item(),
            "heads_keeping_some_needle_token": int((needle_ranks < keep).sum()),
            "num_heads": len(answer_ranks), "even_share_tokens": keep}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--depths", type=float, nargs="+", default=[10, 50, 90])
    parser.add_argument("--kv-pool", type=int, default=POOL, help="the scores' pooling width")
    args = parser.parse_args()
    budget_executor.kept_positions = _record(budget_executor.kept_positions)
    llm = LLM(kv_budget=0.25, kv_policy="ada_snapkv", kv_pool=args.kv_pool)
    rows = [measure(llm, args.length, depth) for depth in args.depths]
    name = "needle_scores_smollm2-135m_cpu.json"
    write_result(name, {"policy": "ada_snapkv 0.25", "kv_pool": args.kv_pool, "rows": rows})
    print(
        f"{'depth':>6} {'found':>6} {'answer rank (median)':>21} {'heads keeping it':>17} "
        f"{'needle best rank':>17} {'heads keeping some':>19}  of {rows[0]['scored_tokens']}"
    )
    for row in rows:
        print(
            f"{row['depth']:>6.0f} {row['found']:>6.0f} {row['answer_rank_median']:>21.0f} "
            f"{row['heads_keeping_answer']:>11}/{row['num_heads']} "
            f"{row['needle_best_rank_median']:>17.0f} "
            f"{row['heads_keeping_some_needle_token']:>13}/{row['num_heads']}"
        )


if __name__ == "__main__":
    main()
