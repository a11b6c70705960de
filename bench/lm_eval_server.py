"""lm-evaluation-harness against a running `headspace serve`: a small multiple-choice task
scored through the server (``--model local-completions``: echo, ``max_tokens`` 0 and
``logprobs``, the log-likelihood requests harnesses send) and through the harness's own
``hf`` backend on the same embedded model, in one run; the two accuracies and each item's
choice compared.

    PYTHONPATH=src python bench/lm_eval_server.py --lm-eval /path/to/env/bin/lm_eval

The harness runs from an environment of its own (``pip install "lm-eval[api,hf]==0.4.13"``
with a CPU torch and transformers; it is not a dependency of headspace). The task is
``bench/lm_eval_task/`` (20 questions over a local JSON file: nothing downloaded). CPU, the
embedded model in float32. Writes ``lm_eval_server_cpu_<date>.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_result  # noqa: E402
from headspace.model.source import resolve_model_dir  # noqa: E402

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "headspace_tiny_mc"
NAME = "SmolLM2-135M-Instruct"


def start_server() -> tuple[subprocess.Popen, str]:
    """``headspace serve`` of the embedded model on the CPU, once /health says ok."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "headspace.cli", "serve", "--port", str(port),
               "--served-model-name", NAME]  # fmt: skip
    server = subprocess.Popen(command, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url, started = f"http://127.0.0.1:{port}", time.perf_counter()
    while time.perf_counter() - started < 300:
        if server.poll() is not None:
            raise SystemExit("the server exited")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("the server was not ready in 300 s")


def task_dir(tmp: Path) -> Path:
    """The task's YAML with the absolute path of its data file."""
    yaml = (TASK_DIR / f"{TASK}.yaml").read_text()
    (tmp / f"{TASK}.yaml").write_text(yaml.replace("DATA_FILE", str(TASK_DIR / "items.json")))
    return tmp


def harness(lm_eval: str, model: str, model_args: str, include: Path, out: Path) -> dict:
    """One ``lm_eval run``: the task's accuracy and each item's chosen answer."""
    command = [lm_eval, "run", "--model", model, "--model_args", model_args, "--tasks", TASK,
               "--include_path", str(include), "--output_path", str(out), "--log_samples",
               "--batch_size", "1"]  # fmt: skip
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": "",
    }  # (the harness's own environment, not this tree's)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"lm_eval failed:\n{done.stderr[-3000:]}")
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for path in out.rglob(f"samples_{TASK}_*.jsonl")
               for line in path.read_text().splitlines()]  # fmt: skip
    chosen = {}
    for sample in samples:
        scores = [float(r[0]) for r in sample["filtered_resps"]]
        chosen[sample["doc_id"]] = max(range(len(scores)), key=scores.__getitem__)
    return {
        "acc": results["results"][TASK]["acc,none"],
        "chosen": chosen,
        "scores": {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in samples},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm-eval", required=True, help="the lm_eval executable to run")
    args = parser.parse_args()
    env = environment()
    model_dir = resolve_model_dir(None)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        tmp = Path(tmp)
        include = task_dir(tmp)
        server, url = start_server()
        try:
            served = harness(args.lm_eval, "local-completions",
                             f"model={NAME},base_url={url}/v1/completions,"
                             f"tokenizer_backend=huggingface,tokenizer={model_dir},"
                             "num_concurrent=1,max_retries=1",
                             include, tmp / "served")  # fmt: skip
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(timeout=120)
        reference = harness(args.lm_eval, "hf", f"pretrained={model_dir},dtype=float32",
                            include, tmp / "hf")  # fmt: skip
    items = sorted(served["chosen"])
    agree = sum(served["chosen"][i] == reference["chosen"][i] for i in items)
    largest = max(
        abs(a - b)
        for i in items
        for a, b in zip(served["scores"][i], reference["scores"][i], strict=True)
    )
    result = {"env": env, "model": NAME, "task": TASK, "items": len(items),
              "accuracy_server": served["acc"], "accuracy_hf": reference["acc"],
              "same_choice": agree, "largest_loglikelihood_difference": largest,
              "harness": "lm-eval 0.4.13, local-completions (echo, max_tokens 0, logprobs) "
                         "against hf on the same model"}  # fmt: skip
    path = write_result(f"lm_eval_server_cpu_{env['date']}.json", result)
    print(f"\nwrote {path}")
    for key in ("items", "accuracy_server", "accuracy_hf", "same_choice",
                "largest_loglikelihood_difference"):  # fmt: skip
        print(f"{key:<36}{result[key]}")


if __name__ == "__main__":
    main()
