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

    ids = llm.tokenizer(builtin_text("alice29"))["input_ids"][:800]
    nll, count = sliding_window_nll(llm.logits, ids, context=512)
    ours = math.exp(nll / count)
    hf = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()

    def hf_logits(window):
        with torch.no_grad():
            return hf(torch.tensor([window])).logits[0]

    nll_hf, count_hf = sliding_window_nll(hf_logits, ids, context=512)
    assert count == count_hf == 799  # every token after the first is scored once
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


class _StoppedAfter:
    """An LLM whose batch is interrupted (Ctrl-C) once ``count`` of its requests have ended."""

    def __init__(self, llm, count: int):
        self.engine, self._llm, self._count = llm.engine, llm, count

    def generate(self, prompts, params, *, on_finish, **options):
        ended = []

        def finish(position, output):
            on_finish(position, output)
            ended.append(position)
            if len(ended) == self._count:
                raise KeyboardInterrupt

        return self._llm.generate(prompts, params, on_finish=finish, **options)


def test_ctrl_c_during_niah_or_ruler_keeps_the_rows_finished(llm):
    """Ctrl-C once some of the batch's requests have ended: EvalInterrupted holds their
    rows, each as the whole run would give it (a batch's rows were all lost before), and
    the engine is free for the next run."""
    from headspace.eval.run import EvalInterrupted, run_niah, run_ruler

    whole = run_niah(llm, [600, 900], [0, 100], max_new_tokens=6)
    with pytest.raises(EvalInterrupted) as stopped:
        run_niah(_StoppedAfter(llm, 2), [600, 900], [0, 100], max_new_tokens=6)
    rows = stopped.value.rows
    assert len(rows) == 2 and all(row in whole for row in rows), rows
    with pytest.raises(EvalInterrupted) as stopped:
        run_ruler(_StoppedAfter(llm, 1), [600], ["niah_single", "common_words"],
                  max_new_tokens=4)  # fmt: skip
    assert len(stopped.value.rows) == 1 and stopped.value.rows[0]["length"] == 600
    assert run_niah(llm, [600], [0], max_new_tokens=6) == whole[:1]


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


def test_ppl_counts_its_windows_up_front_and_keeps_finished_rows_on_ctrl_c(tmp_path):
    """run_ppl says how many windows it will score, then, after the first, how long they
    should take (in every mode a comparison runs); Ctrl-C part-way raises EvalInterrupted
    holding the rows finished."""
    from types import SimpleNamespace

    from headspace.eval.run import EvalInterrupted, ppl_windows, run_ppl

    assert ppl_windows(700, 320) == 4 and ppl_windows(700, 320, decode_tokens=256) == 3
    assert ppl_windows(10, 320) == 1
    text = tmp_path / "text.txt"
    text.write_text("x " * 100)
    calls = []

    def logits(window, decode_tokens=0):
        calls.append(len(window))
        if len(calls) == 5:  # the second row's second window
            raise KeyboardInterrupt
        return torch.zeros(len(window), 8)

    tokenizer = lambda text: {"input_ids": [i % 8 for i in range(len(text.split()))]}  # noqa: E731
    llm = SimpleNamespace(engine=SimpleNamespace(tokenizer=tokenizer), logits=logits)
    said = []
    with pytest.raises(EvalInterrupted) as stopped:
        run_ppl(llm, [str(text)], [40, 60], report=said.append, modes=3)
    rows = stopped.value.rows
    assert [(r["context"], r["tokens"]) for r in rows] == [(40, 99)]  # 40-token windows: 4
    windows = ppl_windows(100, 40) + ppl_windows(100, 60)
    assert said[0] == f"ppl: {windows:,} windows to score in each of 3 modes"
    assert said[1].startswith("ppl: the first window took") and len(said) == 2
    assert f"for all {windows:,} in 3 modes (Ctrl-C" in said[1]  # (a comparison's modes)
    assert rows[0]["perplexity"] == pytest.approx(8.0)  # uniform logits over 8 tokens


def test_eval_ppl_on_the_cpu_defaults_to_short_texts(tmp_path, capsys, embedded_dir):
    """Without --context and --max-tokens, ppl on the CPU reads each text's first 2,048
    tokens at 1K and 2K (said on stderr): minutes, not the hours whole texts take."""
    from conftest import make_tiny_checkpoint
    from headspace.cli.main import main

    model = tmp_path / "tiny"
    make_tiny_checkpoint("llama3", model, embedded_dir)
    text = tmp_path / "text.txt"
    text.write_text("The lighthouse keeper wrote down every ship that passed. " * 400)
    code = main(["eval", "ppl", "--model", str(model), "--text", str(text), "--max-context",
                 "2048", "--output", str(tmp_path / "out")])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "ppl on the CPU: each text's first 2,048 tokens at contexts 1k,2k" in captured.err
    header, *rows = [line.split() for line in captured.out.strip().splitlines()[-3:]]
    assert [row[header.index("context")] for row in rows] == ["1024", "2048"]


def test_ctrl_c_during_eval_ppl_keeps_the_rows_finished(tmp_path, embedded_dir):
    """SIGINT once the first context's row is done (the second's bar shows): exit 130, the
    finished row in a partial CSV, a line that says where; no traceback."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    from conftest import make_tiny_checkpoint

    model = tmp_path / "tiny"
    make_tiny_checkpoint("llama3", model, embedded_dir)
    text = tmp_path / "text.txt"
    text.write_text("The lighthouse keeper wrote down every ship that passed. " * 400)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "headspace.cli", "eval", "ppl", "--model", str(model),
               "--text", str(text), "--context", "32,256", "--max-tokens", "600",
               "--decode-tokens", "64", "--output", str(out)]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
    chunks: list[bytes] = []

    def pump() -> None:  # stderr as it comes (the progress bars end no line)
        while data := os.read(process.stderr.fileno(), 4096):
            chunks.append(data)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while b"@256" not in b"".join(chunks) and time.monotonic() < deadline \
            and process.poll() is None:  # fmt: skip
        time.sleep(0.05)
    assert b"@256" in b"".join(chunks), b"".join(chunks)[-2000:]
    process.send_signal(signal.SIGINT)
    process.wait(timeout=120)
    reader.join(timeout=30)
    seen = b"".join(chunks).decode(errors="replace")
    partial = out / "ppl_partial.csv"
    assert process.returncode == 130, seen[-2000:]
    assert f"interrupted: the 1 rows finished are in {partial}" in seen
    assert "Traceback" not in seen
    lines = partial.read_text().strip().splitlines()
    assert len(lines) == 2 and lines[1].split(",")[1] == "32"  # the header, the 32-token row
