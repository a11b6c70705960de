"""A fresh process's time to its first token: Llama-3.1-8B's shape (random bf16 weights saved
as a checkpoint with a word-level tokenizer), one prompt of 8K tokens, one new token.

    PYTHONPATH=src python bench/cold_start.py [--checkpoint DIR] [--tokens 8192]

Each run is a new process, as a user starts one on a machine set up by ``make setup`` (the
CPU attention library built); the checkpoint is read once before them, so every run finds
it in the page cache. Per engine, two runs over the same compile caches
(``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``, fresh for the first run, kept for the
second): *first* is a machine's first process, *second* one started after it.

- ``headspace``: the command a user types, ``headspace generate --model DIR --prompt-file F
  --max-new-tokens 1 --device cuda``, timed from the outside (its own warm-up line and
  summary kept), then the same steps inside one process, each timed: imports, ``LLM(...)``
  (reading the weights, ``weights_s`` of it, loading the tokenizer, ``tokenizer_s``, and
  building the engine), ``warm_up`` (compilation, graph capture, as the command's for one
  token) and the request (the prompt's prefill and its token).
- ``transformers``: imports, ``from_pretrained`` onto the GPU in bf16 and ``generate`` with
  one new token (its default attention, SDPA).

Each process's ``exit_s`` is the time from its last step to its end (the interpreter's exit,
CUDA's, any compile workers').

Writes ``cold_start_llama3-8b_<gpu>_<date>.json`` (to $OUT when set) with each run's wall
seconds and phases, and ``ttft_ratio_vs_transformers`` for the first and second runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def _phases_headspace(checkpoint: str, prompt_file: str, device: str) -> dict:
    """Inside a fresh process: each step of ``headspace generate``, timed."""
    start = time.perf_counter()
    import torch

    from headspace import LLM
    from headspace.engine.engine import compile_in_process
    from headspace.engine.sampling import SamplingParams

    phases = {"imports_s": time.perf_counter() - start}
    mark = time.perf_counter()
    compile_in_process()  # as the command does
    llm = LLM(checkpoint, device=device)
    if device != "cpu":
        torch.cuda.synchronize()
    phases["load_s"] = time.perf_counter() - mark
    phases["weights_s"] = llm.engine.load_seconds  # of load_s: reading and placing weights
    phases["tokenizer_s"] = llm.engine.tokenizer_seconds  # of load_s, its imports included
    ids = llm.engine.encode(Path(prompt_file).read_text())
    phases["warm_up_s"] = llm.engine.warm_up(
        len(ids), decode=False, offload=True, alone=len(ids) + 1
    )  # as the CLI: 1 token
    mark = time.perf_counter()
    out = llm.engine.run(ids, SamplingParams(max_new_tokens=1, ignore_eos=True))
    phases["request_s"] = time.perf_counter() - mark
    phases["prompt_tokens"] = len(ids)
    phases["summary"] = out.stats.summary()
    return phases


def _phases_transformers(checkpoint: str, prompt_file: str, device: str) -> dict:
    """Inside a fresh process: transformers' load and one-token generate, timed."""
    start = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    phases = {"imports_s": time.perf_counter() - start}
    mark = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    try:  # straight onto the GPU where transformers can (device_map needs accelerate)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16,
                                                     device_map=device)  # fmt: skip
        phases["loaded_by"] = "device_map"
    except (ImportError, ValueError):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(device)
        phases["loaded_by"] = "cpu, then .cuda()"
    if device != "cpu":
        torch.cuda.synchronize()
    phases["load_s"] = time.perf_counter() - mark
    ids = tokenizer(Path(prompt_file).read_text(), return_tensors="pt").input_ids.to(device)
    mark = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False)
    if device != "cpu":
        torch.cuda.synchronize()
    phases["request_s"] = time.perf_counter() - mark
    phases["prompt_tokens"] = ids.shape[1]
    return phases


PHASES = {"headspace": _phases_headspace, "transformers": _phases_transformers}


def _child(command: list[str], caches: Path) -> tuple[float, str, str]:
    """Wall seconds of ``command`` as a new process over the compile caches in ``caches``,
    its stdout and its stderr's last lines."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
           "TRITON_CACHE_DIR": str(caches / "triton")}  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{command[:4]} failed:\n{done.stderr[-3000:]}")
    return wall, done.stdout, "\n".join(done.stderr.strip().splitlines()[-3:])


def _phases(engine: str, checkpoint: str, prompt_file: str, caches: Path, device: str) -> dict:
    command = [sys.executable, __file__, "--phases", engine, "--checkpoint", checkpoint,
               "--prompt-file", prompt_file, "--device", device]  # fmt: skip
    wall, stdout, _ = _child(command, caches)
    phases = json.loads(stdout.strip().splitlines()[-1])
    # the process's teardown after its last step (the interpreter's exit, CUDA's, workers')
    phases["exit_s"] = time.time() - phases.pop("ended_at")
    return {"wall_s": wall, **phases}


def _runs(cli: list[str], checkpoint: str, prompt: str, device: str, scratch: Path) -> dict:
    """Each engine's first and second process, the compile caches under ``scratch``:
    transformers' steps; the headspace command, then its steps in a process of their own
    (the first over caches of their own, the second over those the command's runs filled)."""
    runs: dict[str, dict] = {"headspace_cli": {}, "headspace": {}, "transformers": {}}
    for engine in ("transformers", "headspace"):
        caches = scratch / engine
        for which in ("first", "second"):
            if engine == "headspace":
                wall, _, tail = _child(cli, caches)
                runs["headspace_cli"][which] = {"wall_s": wall, "stderr": tail}
                print("headspace cli", which, f"{wall:.1f} s", tail, flush=True)
                own = caches if which == "second" else scratch / "headspace_steps"
                runs[engine][which] = _phases(engine, checkpoint, prompt, own, device)
            else:
                runs[engine][which] = _phases(engine, checkpoint, prompt, caches, device)
            print(engine, which, runs[engine][which], flush=True)
    return runs


def _prepare(checkpoint: Path, tokens: int) -> Path:
    """The checkpoint (saved once) and a prompt file of ``tokens`` words, each one token;
    every file of the checkpoint read once so that each run finds them in the page cache;
    the CPU attention library built, as ``make setup`` builds it on a user's machine."""
    from headspace.attention.cpu_decode import build
    from serve import save_checkpoint

    build()
    if not (checkpoint / "config.json").exists():
        save_checkpoint(checkpoint)
    for path in checkpoint.iterdir():
        with path.open("rb") as f:
            while f.read(1 << 26):
                pass
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128000, (tokens,), generator=generator).tolist()
    prompt = checkpoint / "prompt.txt"
    prompt.write_text(" ".join(f"t{i}" for i in ids))
    return prompt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", default=str(Path(tempfile.gettempdir()) / "llama8b"))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--device", default="cuda", help="cpu: a check of the script itself")
    parser.add_argument("--phases", choices=tuple(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phases:  # a child: one engine's steps, as JSON on the last line
        phases = PHASES[args.phases](args.checkpoint, args.prompt_file, args.device)
        print(json.dumps({**phases, "ended_at": time.time()}), flush=True)
        return
    from common import environment, gpu_tag, write_result

    env = environment() if args.device != "cpu" else {"gpu": "cpu", "date": "check"}
    checkpoint = Path(args.checkpoint)
    prompt = str(_prepare(checkpoint, args.tokens))
    cli = [sys.executable, "-m", "headspace", "generate", "--model", str(checkpoint),
           "--prompt-file", prompt, "--max-new-tokens", "1", "--device", args.device]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="cold_start_") as scratch:  # the compile caches
        runs = _runs(cli, str(checkpoint), prompt, args.device, Path(scratch))
    result = {
        "env": env, "config": {"model": "llama3-8b (random bf16)", "prompt_tokens": args.tokens,
                               "max_new_tokens": 1},
        "runs": runs,
        "ttft_s": {which: {"headspace": runs["headspace_cli"][which]["wall_s"],
                           "transformers": runs["transformers"][which]["wall_s"]}
                   for which in ("first", "second")},
    }  # fmt: skip
    result["ttft_ratio_vs_transformers"] = {
        which: times["headspace"] / times["transformers"]
        for which, times in result["ttft_s"].items()
    }
    if args.device != "cpu":
        write_result(f"cold_start_llama3-8b_{gpu_tag(env)}_{env['date']}.json", result)
    _print(result)


def _print(result: dict) -> None:
    columns = ("imports_s", "load_s", "weights_s", "tokenizer_s", "warm_up_s", "request_s",
               "exit_s")  # fmt: skip
    print(f"\n{'run':>7} {'engine':>13} {'wall s':>7} "
          + " ".join(f"{c[:-2]:>9}" for c in columns))  # fmt: skip
    for engine in ("headspace", "transformers"):
        for which, row in result["runs"][engine].items():
            print(f"{which:>7} {engine:>13} {row['wall_s']:>7.1f} "
                  + " ".join(f"{row.get(c, float('nan')):>9.1f}" for c in columns))  # fmt: skip
    for which, ratio in result["ttft_ratio_vs_transformers"].items():
        print(
            f"{which} process: headspace generate {result['ttft_s'][which]['headspace']:.1f} s, "
            f"transformers {result['ttft_s'][which]['transformers']:.1f} s ({ratio:.2f}x)"
        )


if __name__ == "__main__":
    main()
