"""The README's Python snippets run as written on the CPU (the embedded model), one after
the other in one namespace, as a reader would paste them."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_snippets_run_as_written(capsys):
    snippets = _snippets()
    assert len(snippets) >= 2  # the API's and the engine's
    namespace: dict = {}
    for code in snippets:
        exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 (the README's own)
    outs, logits = namespace["outs"], namespace["logits"]
    assert len(outs) == 2 and all(out.finish_reason in ("length", "stop") for out in outs)
    assert logits.dtype == torch.float32
    assert logits.shape == (len(outs[0].token_ids), namespace["llm"].engine.model.config.vocab_size)
    assert not namespace["llm"].engine.has_unfinished()  # the engine loop ran to its end
    assert capsys.readouterr().out  # the stream and the loop printed


def test_readme_python_snippets_are_formatted_as_the_code_is():
    """Each snippet as ``ruff format`` leaves it (the tree's own style, checked by make test)."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    for code in _snippets():
        done = subprocess.run([ruff, "format", "--check", "--stdin-filename", "README.py", "-"],
                              input=code, capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, code


def _commands() -> list[list[str]]:
    """The README's shell commands, each split as bash would (continued lines joined,
    comments and a trailing ``&`` dropped)."""
    import shlex

    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    words = [shlex.split(line, comments=True) for line in lines]
    return [w[:-1] if w[-1:] == ["&"] else w for w in words if w]


def test_readme_commands_that_need_no_file_or_gpu_run_as_written():
    """``generate`` with the embedded model, and ``serve`` driven by the README's own curl
    body (on a free port in place of 8000): what a reader tries first."""
    import json
    import subprocess
    import sys
    from urllib.parse import urlsplit

    import httpx

    from server_process import ServerProcess

    commands = _commands()
    plain = [c for c in commands if c[:2] == ["headspace", "generate"]
             and not {"--model", "--prompt-file"} & set(c)]  # fmt: skip
    assert plain, commands
    for command in plain:
        done = subprocess.run([sys.executable, "-m", "headspace.cli", *command[1:]],
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0 and done.stdout.strip(), done.stderr[-2000:]
        assert "Paris" in done.stdout, done.stdout  # the embedded model knows this one
    serve = next(c for c in commands if c[:2] == ["headspace", "serve"] and "--model" not in c)
    curl = next(c for c in commands if c[0] == "curl")
    flags = serve[2:]
    del flags[flags.index("--port") : flags.index("--port") + 2]
    server = ServerProcess(*flags)
    try:
        body = json.loads(curl[curl.index("-d") + 1])
        path = urlsplit("http://" + next(w for w in curl if w.startswith("localhost:"))).path
        reply = httpx.post(server.url + path, json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["model"] == body["model"] and answer["choices"][0]["message"]["content"]
    finally:
        server.stop()
