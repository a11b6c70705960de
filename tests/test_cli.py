"""The command line: output on success; one-line errors with exit code 2 on bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from headspace.cli.main import main


def _run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_user_error(code, err, message):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, embedded_dir):
    from conftest import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("cli-tiny")
    make_tiny_checkpoint("llama2", path, embedded_dir)
    return path


def test_generate_streams_answer_and_summary(capsys):
    code, out, err = _run(
        capsys,
        "generate",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-new-tokens",
        "20",
    )
    assert code == 0 and "Paris" in out
    assert "prompt" in err and "decode" in err and "tok/s" in err


def test_prompt_file_and_question_are_joined(capsys, tmp_path):
    document = tmp_path / "doc.txt"
    document.write_text("The secret code word is 'marmalade'.\n")
    code, out, _ = _run(
        capsys,
        "generate",
        "--chat",
        "--prompt-file",
        str(document),
        "--prompt",
        "What is the secret code word?",
        "--max-new-tokens",
        "24",
    )
    assert code == 0 and "marmalade" in out.lower()


def test_missing_model_directory(capsys, tmp_path):
    code, _, err = _run(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    _assert_user_error(code, err, "does not exist")


def test_directory_without_config(capsys, tmp_path):
    code, _, err = _run(capsys, "generate", "--model", str(tmp_path), "--prompt", "x")
    _assert_user_error(code, err, "has no config.json")


def test_malformed_config(capsys, tmp_path, tiny_dir):
    shutil.copytree(tiny_dir, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{ not json")
    code, _, err = _run(capsys, "generate", "--model", str(tmp_path / "m"), "--prompt", "x")
    _assert_user_error(code, err, "malformed config.json")


def test_unsupported_architecture(capsys, tmp_path, tiny_dir):
    shutil.copytree(tiny_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    code, _, err = _run(capsys, "generate", "--model", str(tmp_path / "m"), "--prompt", "x")
    _assert_user_error(code, err, "unsupported architecture GPT2LMHeadModel")


def test_corrupted_safetensors(capsys, tmp_path, tiny_dir):
    shutil.copytree(tiny_dir, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    code, _, err = _run(capsys, "generate", "--model", str(tmp_path / "m"), "--prompt", "x")
    _assert_user_error(code, err, "corrupted safetensors file model.safetensors")


def test_corrupted_gguf_writes_nothing(capsys, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HEADSPACE_CACHE", str(cache))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(2000))
    code, _, err = _run(capsys, "generate", "--model", str(bad), "--prompt", "x")
    _assert_user_error(code, err, "corrupted or unreadable GGUF file")
    assert not cache.exists() or not any(p.is_file() for p in cache.rglob("*"))


def test_prompt_longer_than_context_and_override(capsys, tiny_dir):
    long_prompt = "word " * 700  # tiny models have a 512-token context
    code, _, err = _run(capsys, "generate", "--model", str(tiny_dir), "--prompt", long_prompt)
    _assert_user_error(code, err, "does not fit the context of 512 tokens")
    code, out, err = _run(
        capsys,
        "generate",
        "--model",
        str(tiny_dir),
        "--prompt",
        long_prompt,
        "--max-context",
        "2048",
        "--max-new-tokens",
        "4",
    )
    assert code == 0
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "past the model's trained context of 512" in notes[0]
    code, _, err = _run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "word " * 10,
                        "--max-context", "2048", "--max-new-tokens", "4")  # fmt: skip
    assert code == 0 and "note: " not in err  # (within the trained context: no note)
    # the last new token is predicted, never run: a prompt and new tokens one past the
    # trained context run within it
    from headspace import LLM

    prompt = "word " * 500
    room = 512 - len(LLM(str(tiny_dir)).engine.encode(prompt)) + 1
    for new, noted in ((room, False), (room + 1, True)):
        code, _, err = _run(capsys, "generate", "--model", str(tiny_dir), "--prompt", prompt,
                            "--max-context", "2048", "--max-new-tokens", str(new))  # fmt: skip
        assert code == 0 and ("past the model's trained context" in err) == noted, (new, err)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "2"], "top_p must be in (0, 1]"),
        (["--top-k", "-3"], "top_k must be a non-negative integer"),
        (["--max-new-tokens", "0"], "max_new_tokens must be a positive integer"),
        (["--max-new-tokens", "many"], "invalid int value"),
        (["--dtype", "int8"], "invalid choice"),
        (["--prefill-chunk", "0"], "prefill_chunk must be a positive integer"),
        (["--device", "tpu"], "device must be 'cpu' or 'cuda[:N]'"),
    ],
)
def test_invalid_option_values(capsys, tiny_dir, flags, message):
    code, _, err = _run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "x", *flags)
    _assert_user_error(code, err, message)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--gpu-memory", "-1GiB"], "argument --gpu-memory: cannot read '-1GiB'"),
        (["--gpu-memory", "banana"], "argument --gpu-memory: cannot read 'banana'"),
        (["--host-memory", "banana"], "argument --host-memory: cannot read 'banana'"),
        (["--kv-budget", "-1"], "argument --kv-budget: cannot read '-1'"),
        (["--kv-budget", "2"], "a token count such as 2048tok"),
        (["--kv-budget", "2tok"], "below the 32-token observation window"),
        # on the CPU the GPU budget is host memory: refused past what is available, before
        # the kernel kills the process part-way through allocating it
        (["--gpu-memory", "1000TiB"], "on the CPU the GPU memory budget is host memory: its"),
    ],
)
def test_budget_flags_name_themselves_and_their_units(capsys, tiny_dir, flags, message):
    code, _, err = _run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "x", *flags)
    _assert_user_error(code, err, message)


def test_version_and_grouped_help(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("headspace 0.")
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = capsys.readouterr().out
    sections = ["sampling:", "runtime:", "memory and tiers:", "budgets and patterns:"]
    assert all(section in help_text for section in sections)
    assert help_text.index("sampling:") < help_text.index("\n  --top-p")
    assert "(default: 256)" in help_text and "(default: 128)" in help_text  # new tokens, page
    flat = " ".join(help_text.split())  # (the help wraps at the terminal's width)
    assert re.search(r"--cuda-graph, --no-cuda-graph [^-]*\(default: on\)", flat)
    # the multi-GPU group where it can act (several GPUs, or under torchrun), not here
    several = torch.cuda.device_count() > 1 or "LOCAL_WORLD_SIZE" in os.environ
    assert ("multi-GPU (under torchrun):" in help_text) == several
    assert ("--balance" in help_text) == several


def test_version_and_help_answer_without_torch():
    """``--version``, ``--help``, no command at all and each command's ``--help`` run in a
    process where importing torch fails (so none of them waits for it: a command's help
    took 2.4 s on 2 cores when its flags imported torch), the help listing every
    subcommand, and a command's its flags."""
    from headspace.cli.commands import COMMAND_HELP

    commands = [([name, "--help"], 0) for name in COMMAND_HELP] + [(["eval", "ppl", "-h"], 0)]
    for argv, code in ((["--version"], 0), (["--help"], 0), (["-h"], 0), ([], 2), *commands):
        script = ("import sys; sys.modules['torch'] = None\n"
                  "from headspace.cli.main import main\n"
                  f"sys.exit(main({argv!r}))")  # fmt: skip
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == code, done.stderr
        if argv == ["--version"]:
            assert done.stdout.startswith("headspace 0.")
        elif argv[:1] in (["generate"], ["serve"]):
            assert "--gpu-memory" in done.stdout and "--kv-budget" in done.stdout
        elif argv[:1] in [[name] for name in COMMAND_HELP]:
            assert done.stdout.startswith(f"usage: headspace {argv[0]}"), done.stdout
        else:
            assert all(name in done.stdout for name in COMMAND_HELP), done.stdout


def test_the_gpus_the_help_counts_are_the_drivers_narrowed_by_cuda_visible_devices(
        tmp_path, monkeypatch):  # fmt: skip
    from headspace.parallel.launch import visible_gpus

    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (tmp_path / bus).mkdir()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus(str(tmp_path)) == 3
    assert visible_gpus(str(tmp_path / "none")) == 0  # no driver: no GPU
    for named, seen in (("1", 1), ("0,2", 2), ("", 0), ("0,1,2,3,4", 3), ("-1", 0),
                        ("0,-1,1", 1), ("GPU-8e6a,1", 2)):  # fmt: skip
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", named)
        assert visible_gpus(str(tmp_path)) == seen


def test_multi_gpu_flags_parse_where_the_help_leaves_them_out(capsys, tiny_dir):
    code, _, err = _run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "x",
                        "--balance", "nonsense")  # fmt: skip
    assert code == 2 and err.startswith("error: argument --balance: invalid choice")
    assert "greedy" in err  # the flag is known, with its choices; only its help is left out


def test_summary_says_why_generation_ended(capsys, tiny_dir):
    code, _, err = _run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "x y z",
                        "--max-new-tokens", "3")  # fmt: skip
    # one vocabulary: the API's finish reason first, then the cause in detail
    assert code == 0 and err.strip().endswith("ended: length (max_new_tokens)")


def test_load_and_warm_up_are_reported_on_their_own_lines(capsys, tiny_dir):
    """Loading the weights, then the warm-up request, each timed apart on its own line: the
    summary counts the user's prompt alone, as it does without a warm-up."""
    args = ("generate", "--model", str(tiny_dir), "--prompt", "x y z", "--max-new-tokens", "3")
    code, out, err = _run(capsys, *args)
    load, warm, *_, summary = err.strip().splitlines()
    assert code == 0 and re.fullmatch(
        r"load \d+\.\d s \(0\.\d\d GB of weights read in \d+\.\d s\)", load
    )
    # (on the CPU nothing compiles: the line says so)
    assert re.fullmatch(r"warm-up \d+\.\d s \(a first request, no compilation\)", warm)
    code, cold_out, cold_err = _run(capsys, *args, "--no-warm-up")
    assert code == 0 and "warm-up" not in cold_err and cold_out == out
    assert cold_err.startswith("load ")
    assert summary.split(" | ")[0] == cold_err.strip().splitlines()[-1].split(" | ")[0]


def test_plan_says_when_the_context_is_past_the_trained_one(capsys):
    code, out, _ = _run(capsys, "plan", "--context", "16K", "--gpu-memory", "24GiB",
                        "--host-memory", "8GiB")  # fmt: skip
    assert code == 0
    assert "past the model's trained context of 8,192; generate runs it only with" in out
    # the head map's grid comes with what its marks mean, right below it
    grid_end = out.index("\nlegend: ")
    assert out[:grid_end].rsplit("\n", 1)[-1].startswith("layer ")
    assert all(f"{mark} " in out[grid_end:] for mark in ("G", "S", "H"))


def test_plan_without_a_gpu_asks_for_both_budgets_at_once(capsys):
    """On a machine without a GPU, plan names both flags it needs in one error; with the
    GPU's given, a refusal for want of this machine's host memory says which flag sets
    the planned machine's."""
    if torch.cuda.is_available():
        pytest.skip("a GPU here: plan reads its memory")
    code, _, err = _run(capsys, "plan", "--context", "32K")
    _assert_user_error(code, err, "pass --gpu-memory (e.g. 24GiB) and --host-memory")
    code, _, err = _run(capsys, "plan", "--context", "64M", "--gpu-memory", "24GiB")
    _assert_user_error(code, err, "host budget (this machine's available memory: "
                                  "--host-memory sets the planned machine's)")  # fmt: skip
    code, _, err = _run(capsys, "plan", "--context", "32K", "--gpu-memory", "24GiB",
                        "--host-memory", "64GiB")  # fmt: skip
    assert code == 0


def test_cuda_without_gpu(capsys, tiny_dir, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code, _, err = _run(
        capsys, "generate", "--model", str(tiny_dir), "--prompt", "x", "--device", "cuda"
    )
    _assert_user_error(code, err, "no CUDA GPU is available")


def test_console_script_prints_one_line_and_no_traceback(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "headspace.cli",
            "generate",
            "--model",
            str(tmp_path / "missing"),
            "--prompt",
            "hello",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: model path {tmp_path / 'missing'} does not exist"
    assert "Traceback" not in result.stderr and result.stdout == ""


def _non_default(name, f):
    """A value other than the command line's default for the engine option ``name`` (its
    field ``f``), as a flag argument and as parsed."""
    values = {
        "device": ("cuda:1", "cuda:1"),
        "dtype": ("bfloat16", "bfloat16"),
        "attention_backend": ("reference", "reference"),
        "offload": ("head", "head"),
        "gpu_memory": ("3GiB", "3GiB"),
        "host_memory": ("5GiB", "5GiB"),
        "cpu_share": ("0.25", 0.25),
        "kv_policy": ("ada_snapkv", "ada_snapkv"),
        "profile": ("smol.json", "smol.json"),
        "retrieval_heads": ("0.5", 0.5),
        "sparse_pattern": ("streaming(4,64)", "streaming(4,64)"),
        "balance": ("greedy", "greedy"),
        "balance_phase": ("decode", "decode"),
        "weights": ("stream", "stream"),
        "kv_budget": ("64tok", 64),
        "prompt_order": ("arrival", "arrival"),
    }  # a token count says so (a bare 7 is refused)
    if name in values:
        return values[name]
    if f.type == "bool":
        return None, not f.metadata.get("cli_default", f.default)
    return "7", 7


def _engine_flags() -> dict:
    """Every flag a command running the engine derives from a config field: the fields of
    the engine's option groups, and the head-parallel ones (ParallelConfig's)."""
    from dataclasses import fields

    from headspace.engine.config import GROUPS
    from headspace.engine.config_fields import flat_name
    from headspace.parallel.config import ENGINE_FIELDS, ParallelConfig

    flags = {flat_name(f): f for group in GROUPS.values() for f in fields(group)}
    return flags | {f.name: f for f in fields(ParallelConfig) if f.name in ENGINE_FIELDS}


@pytest.mark.parametrize("command", ["generate", "eval"])
@pytest.mark.parametrize("field", list(_engine_flags()))
def test_every_engine_flag_reaches_the_engine(monkeypatch, capsys, field, command):
    f = _engine_flags()[field]
    argument, expected = _non_default(field, f)
    flag = "--" + field.replace("_", "-")
    if argument is None:  # a boolean: --flag or --no-flag
        flag = flag if expected else "--no-" + field.replace("_", "-")
    seen = {}

    class Recorder:
        def __init__(self, model=None, **options):
            seen.update(options)
            raise KeyboardInterrupt  # stop before any work

    monkeypatch.setattr("headspace.api.LLM", Recorder)
    args = [flag] if argument is None else [flag, argument]
    if command == "generate":
        code = main(["generate", "--prompt", "x", *args])
    else:
        code = main(["eval", "niah", "--lengths", "1k", *args])
    assert code == 130 and seen[field] == expected
    assert set(seen) == set(_engine_flags())


def test_generate_with_a_budget_below_the_weights_exits_with_the_numbers(capsys):
    code, _, err = _run(capsys, "generate", "--prompt", "x", "--gpu-memory", "100MB")
    _assert_user_error(code, err, "GPU budget too small: 95.4 MiB holds the weights (513.1 MiB)")


def test_generate_honours_the_budget_and_reports_the_tiers(capsys):
    """600MB cannot hold the embedded model's 8K context (0.38 GiB of fp32 KV) beside its
    0.50 GiB of weights, but a short request fits: all resident. At 575MB its 293 tokens
    (prompt + 256 new) do not fit the pool: some heads stream, with the same answer."""
    question = ["generate", "--chat", "--prompt", "What is the capital of France?"]
    code, out, err = _run(capsys, *question, "--max-new-tokens", "12", "--gpu-memory", "600MB")
    assert code == 0 and "Paris" in out
    assert "heads 90 resident / 0 streamed" in err
    code, streamed_out, err = _run(capsys, *question, "--gpu-memory", "575MB")
    assert code == 0 and streamed_out.startswith(out.strip())
    streamed = int(err.split(" resident / ")[1].split(" streamed")[0])
    assert 0 < streamed < 90


def test_ctrl_c_during_decode_ends_the_line_and_prints_the_summary():
    """SIGINT while tokens stream (``python -m headspace``, as a user runs it): the partial
    text ends with a newline, the summary says how far it got and why it ended, exit 130."""
    import signal
    import time

    args = ["-m", "headspace", "generate", "--no-warm-up", "--max-new-tokens", "400",
            "--prompt", "Count from 1 to 1000: 1, 2, 3,"]  # fmt: skip
    # Ctrl-C as at a terminal: a suite started in the background ignores SIGINT, and so
    # would its children; this process restores the default before it becomes headspace
    start = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
             "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")  # fmt: skip
    command = [sys.executable, "-c", start, *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    fd = process.stdout.fileno()
    os.set_blocking(fd, False)
    printed, deadline = b"", time.monotonic() + 120
    while printed.count(b",") < 3 and time.monotonic() < deadline and process.poll() is None:
        try:  # the raw descriptor: what has arrived, never held in a buffer
            printed += os.read(fd, 1 << 16)
        except BlockingIOError:
            time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    rest, err = process.communicate(timeout=60)
    text, err = (printed + rest).decode(), err.decode()
    assert process.returncode == 130, err
    assert text.endswith("\n") and text.count(",") >= 3
    summary = err.strip().splitlines()[-1]
    assert "ended: abort (interrupted)" in summary and "decode" in summary, err
    generated = int(re.search(r"\((\d+) tokens\)", summary).group(1))
    assert 3 <= generated < 400


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ppl", "--context", "0"], "--context: every length must be at least 2 tokens"),
        (["ppl", "--max-tokens", "0", "--context", "64"], "--max-tokens must be at least 2"),
        (["ppl", "--decode-tokens", "-1"], "--decode-tokens must be at least 0"),
        (["ruler", "--samples", "0", "--lengths", "1k"], "--samples must be at least 1"),
        (["ppl", "--compare", "none", "snapkv:2"], "'snapkv:2': cannot read '2'"),
        (["ppl", "--compare", "none", "snapkv:2tok"], "below the 32-token observation window"),
    ],
)
def test_eval_refuses_what_would_score_nothing_before_any_run(capsys, tmp_path, argv, message):
    code, _, err = _run(capsys, "eval", *argv, "--output", str(tmp_path))
    _assert_user_error(code, err, message)
    assert not list(tmp_path.iterdir())  # no mode ran before the refusal


def test_an_offload_mode_the_request_did_not_need_is_said(capsys, tiny_dir):
    """``--offload head`` on a prompt whose KV fits runs all resident: a note says so; the
    default mode gets no note."""
    args = ("generate", "--model", str(tiny_dir), "--prompt", "x y", "--max-new-tokens", "2")
    code, _, err = _run(capsys, *args, "--offload", "head")
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert code == 0 and notes == [
        "note: --offload head was not needed: the request's KV fit the GPU budget, so every "
        "head stayed resident"
    ]
    code, _, err = _run(capsys, *args)
    assert code == 0 and "note: " not in err


def test_a_kv_budget_on_a_short_prompt_or_keeping_almost_all_gets_a_note(capsys, tiny_dir):
    """A budget over a prompt within its observation window keeps everything (the note says
    why); over a prompt short of the window over its share, it keeps the window, not its
    share (said, with the prompt it needs); one that keeps 90% or more is said to save
    little; a real cut, nothing."""
    from headspace.budgets import KVBudget
    from headspace.cli.main import summary_notes
    from headspace.engine.outputs import GenerationStats

    code, _, err = _run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "x y z",
                        "--kv-budget", "0.5", "--max-new-tokens", "2")  # fmt: skip
    assert code == 0 and "within the KV budget's 32-token observation window" in err

    def notes(fraction: float) -> list[str]:
        stats = GenerationStats(prompt_tokens=4096, kv_held_bytes=1, kv_held_fraction=fraction)
        return summary_notes(stats, "auto")

    assert notes(0.95) and "kept 95% of the full KV: it saves little" in notes(0.95)[0]
    assert notes(0.25) == []
    # a prompt past the window but short of window / share: the window sets what is kept
    # (the case: 65 tokens under 0.25 kept 32 a head, 89.6% held with the new ones)
    raised = GenerationStats(prompt_tokens=65, kv_held_bytes=1, kv_held_fraction=0.896)
    said = summary_notes(raised, "auto", KVBudget(0.25, "snapkv"))
    assert said == ["the KV budget keeps 32 of the prompt's 65 tokens a head (49%), not the "
                    "25% asked: every policy keeps its 32-token observation window, so a 25% "
                    "budget needs a prompt of 128 tokens or more"]  # fmt: skip
    assert summary_notes(GenerationStats(prompt_tokens=128, kv_held_bytes=1,
                                         kv_held_fraction=0.3), "auto",
                         KVBudget(0.25, "snapkv")) == []  # fmt: skip
    words = " ".join(["harbour", "light", "keeper", "dawn", "tide"] * 12)  # 60 words
    code, _, err = _run(capsys, "generate", "--model", str(tiny_dir), "--prompt", words,
                        "--kv-budget", "0.25", "--max-new-tokens", "2")  # fmt: skip
    assert code == 0 and "not the 25% asked: every policy keeps its 32-token" in err


def test_a_budget_the_engine_cannot_split_is_refused_when_the_llm_is_made(embedded_dir):
    """A budget that holds the weights and one sequence's decode but not the engine's batch
    of them is refused by ``LLM(...)`` itself, with the numbers, not by its first request."""
    from headspace import LLM, UserError

    with pytest.raises(UserError, match="GPU budget too small: 534.1 MiB holds the weights"):
        LLM(str(embedded_dir), gpu_memory="560MB", offload="head")
    LLM(str(embedded_dir), gpu_memory="570MB", offload="head")  # enough: made
