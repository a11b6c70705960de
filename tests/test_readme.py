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
