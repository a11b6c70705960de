"""Evaluation harness: deterministic generators, exact scorers, a real end-to-end needle."""

from __future__ import annotations

import math

import pytest
import torch

from headspace import LLM
from headspace.eval.data import haystack_text
from headspace.eval.niah import Needle, build_case, count_occurrences, score
from headspace.eval.ppl import sliding_window_nll
from headspace.eval.ruler import TASKS, make_case


@pytest.fixture(scope="module")
def llm(embedded_dir):
    return LLM()


@pytest.fixture(scope="module")
def haystack_ids(llm):
    return llm.tokenizer(haystack_text(), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("length", [1024, 2048, 4000])
@pytest.mark.parametrize("depth", [0, 25, 50, 75, 100])
def test_needle_once_at_depth_and_prompt_at_length(llm, haystack_ids, length, depth):
    encode = lambda text: llm.engine.encode(text, chat=True)  # noqa: E731
    case = build_case(llm.tokenizer, encode, haystack_ids, length, depth)
    again = build_case(llm.tokenizer, encode, haystack_ids, length, depth)
    assert case == again  # deterministic
    assert abs(len(case.prompt_ids) - length) <= 0.01 * length
    assert abs(case.actual_depth - depth) <= 1.0
    answer_ids = llm.tokenizer(" Dolores Park", add_special_tokens=False)["input_ids"]
    assert count_occurrences(case.prompt_ids, answer_ids) == 1
    assert llm.tokenizer.decode(case.prompt_ids).count(Needle().answer) == 1


def test_niah_scorer_is_exact_match_of_the_answer():
    assert score("Dolores Park", "Sit in dolores park on a sunny day.") == 1.0
    assert score("Dolores Park", "Golden Gate Park is nice.") == 0.0


def test_embedded_model_finds_a_needle_at_2k(llm, haystack_ids):
    from headspace.eval.run import run_niah

    rows = run_niah(llm, [2048], [50])
    assert rows[0]["score"] == 1.0, rows[0]["generation"]


@pytest.mark.parametrize("task", TASKS)
def test_ruler_cases_are_deterministic_and_scored_exactly(task):
    filler = haystack_text()[:20000]
    case = make_case(task, 1500, seed=3, filler=filler)
    assert case == make_case(task, 1500, seed=3, filler=filler)
    assert case != make_case(task, 1500, seed=4, filler=filler)
    assert case.score(" ".join(case.answers)) == 1.0  # the correct answer is accepted
    assert case.distractors and all(case.score(d) == 0.0 for d in case.distractors)
    assert case.score(" ".join(case.distractors)) == 0.0
    if task.startswith("niah") or task == "variable_tracking":
        assert all(answer in case.text for answer in case.answers)
    if task == "common_words":
        listing = case.text.split("\n\n")[0].split()
        counts = {w: listing.count(w) for w in set(listing) if w.isalpha()}
        assert set(sorted(counts, key=counts.get, reverse=True)[:10]) == set(case.answers)


def test_perplexity_matches_transformers(llm, embedded_dir):
    from transformers import AutoModelForCausalLM

    from headspace.eval.data import builtin_text

    ids = llm.tokenizer(builtin_text("alice29"))["input_ids"][:1200]
    nll, count = sliding_window_nll(llm.logits, ids, context=512)
    ours = math.exp(nll / count)
    hf = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()

    def hf_logits(window):
        with torch.no_grad():
            return hf(torch.tensor([window])).logits[0]

    nll_hf, count_hf = sliding_window_nll(hf_logits, ids, context=512)
    assert count == count_hf == 1199  # every token after the first is scored once
    assert abs(ours / math.exp(nll_hf / count_hf) - 1) < 0.005
    assert 1 < ours < 200


def test_eval_cli_writes_csv_heatmap_and_table(tmp_path, capsys, llm):
    import csv

    from headspace.cli.main import main

    code = main(["eval", "niah", "--lengths", "1k", "--depths", "50", "--output", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "score" in out and "1024" in out
    with open(tmp_path / "niah.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 1 and float(rows[0]["score"]) in (0.0, 1.0)
    assert (tmp_path / "niah.png").read_bytes()[:4] == b"\x89PNG"


def test_eval_cli_refuses_a_partial_needle(capsys):
    from headspace.cli.main import main

    code = main(["eval", "niah", "--needle", "The code is 42.", "--lengths", "1k"])
    assert code == 2
    assert capsys.readouterr().err.strip() == "error: --needle, --question and --answer go together"


def test_ruler_accuracy_is_averaged_per_task_and_length():
    from headspace.eval.run import accuracy_by

    rows = [{"task": "a", "length": 1, "score": 1.0}, {"task": "a", "length": 1, "score": 0.0},
            {"task": "b", "length": 1, "score": 0.5}]  # fmt: skip
    assert accuracy_by(rows, ["task", "length"]) == [
        {"task": "a", "length": 1, "accuracy": 0.5, "cases": 2},
        {"task": "b", "length": 1, "accuracy": 0.5, "cases": 1},
    ]


def test_ruler_end_to_end_on_the_embedded_model(llm):
    from headspace.eval.run import run_ruler

    tasks = ["niah_single", "variable_tracking", "common_words", "frequent_words"]
    rows = run_ruler(llm, [768], tasks, seed=1, max_new_tokens=8)
    assert [r["task"] for r in rows] == tasks
    for row in rows:  # fitted in tokens: a word list takes several tokens a word
        assert 0.0 <= row["score"] <= 1.0
        assert 0.9 * 768 <= row["prompt_tokens"] <= 768


def test_ppl_compare_scores_budgets_at_decode(tmp_path, capsys, embedded_dir):
    """Without --decode-tokens a KV budget would never act (every token scored at prefill,
    before compression): approximate modes are scored through decode steps, every mode
    alike, and the table says how many tokens each figure rests on."""
    from conftest import make_tiny_checkpoint
    from headspace.cli.main import main

    model = tmp_path / "tiny"
    make_tiny_checkpoint("llama3", model, embedded_dir)
    text = tmp_path / "text.txt"
    text.write_text("The lighthouse keeper wrote down every ship that passed. " * 80)
    code = main(["eval", "ppl", "--model", str(model), "--text", str(text), "--context", "320",
                 "--max-tokens", "700", "--compare", "none", "snapkv:0.25",
                 "--output", str(tmp_path / "out")])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "last 256 tokens are scored through decode steps" in captured.err
    header, row = [line.split() for line in captured.out.strip().splitlines()[-2:]]
    values = dict(zip(header, row, strict=True))
    assert values["tokens"] == "636"  # every token after the first 64 (history only)
    assert values["perplexity[none]"] != values["perplexity[snapkv:0.25]"]  # the budget acted
