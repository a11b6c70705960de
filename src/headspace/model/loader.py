"""Load HF safetensors checkpoints (HF tensor names) into the lean decoder."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from headspace.errors import UserError
from headspace.model.config import ModelConfig, load_config
from headspace.model.llama import LlamaModel
from headspace.model.rope import inverse_frequencies

GetTensor = Callable[[str], torch.Tensor]


def _layer_tensors(prefix: str, config: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensor names concatenated (dim 0) to form it."""
    attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
    names = {
        "input_norm.weight": [f"{prefix}.input_layernorm.weight"],
        "post_attention_norm.weight": [f"{prefix}.post_attention_layernorm.weight"],
        "qkv_proj.weight": [f"{attn}.{p}_proj.weight" for p in "qkv"],
        "o_proj.weight": [f"{attn}.o_proj.weight"],
        "gate_up_proj.weight": [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"],
        "down_proj.weight": [f"{mlp}.down_proj.weight"],
    }
    if config.qkv_bias:
        names["qkv_proj.bias"] = [f"{attn}.{p}_proj.bias" for p in "qkv"]
    if config.o_bias:
        names["o_proj.bias"] = [f"{attn}.o_proj.bias"]
    if config.mlp_bias:
        names["gate_up_proj.bias"] = [f"{mlp}.gate_proj.bias", f"{mlp}.up_proj.bias"]
        names["down_proj.bias"] = [f"{mlp}.down_proj.bias"]
    return names


def checkpoint_layout(config: ModelConfig) -> dict[str, list[str]]:
    """Every parameter of LlamaModel -> the HF tensor names it is built from."""
    layout = {
        "embed_tokens.weight": ["model.embed_tokens.weight"],
        "norm.weight": ["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        layout["lm_head.weight"] = ["lm_head.weight"]
    for i in range(config.num_layers):
        for ours, theirs in _layer_tensors(f"model.layers.{i}", config).items():
            layout[f"layers.{i}.{ours}"] = theirs
    return layout


def build_model(
    config: ModelConfig,
    get_tensor: GetTensor,
    device: str | torch.device,
    dtype: torch.dtype,
    keep: Callable[[int, torch.nn.Module], None] | None = None,
    layer_device: str | torch.device | None = None,
    read_ahead: int = 0,
) -> LlamaModel:
    """Build a LlamaModel on ``device``/``dtype`` from HF-named tensors given by ``get_tensor``;
    its decoder layers on ``layer_device`` (default ``device``; "cpu" to stream them).

    ``keep(i, layer)`` is called on each decoder layer once its weights are in place in host
    memory, before they move to ``layer_device``: a rank that keeps only its part of each
    layer never holds the whole model on its GPU (nor more than one whole layer on the host,
    besides the tensors read ahead).
    ``read_ahead``: tensors read and moved by that many threads ahead of the one placed, at
    most twice as many at once (``get_tensor`` then called from them, in no set order); 0
    reads them in turn."""
    # a plain "cuda" names this thread's current GPU: the readers' threads start on GPU 0
    device = _on_current_gpu(device)
    layer_device = device if layer_device is None else _on_current_gpu(layer_device)
    with torch.device("meta"):
        model = LlamaModel(config)
    params = dict(model.named_parameters())
    layer_of = {name: int(name.split(".")[1]) for name in params if name.startswith("layers.")}
    pending = None  # the layer whose weights are in host memory, waiting for ``keep``

    def read(name: str, sources: list[str]) -> list[torch.Tensor]:
        index = layer_of.get(name)
        target = device if index is None else "cpu" if keep is not None else layer_device
        return [get_tensor(src).to(device=target, dtype=dtype) for src in sources]

    for name, sources, parts in _in_order(checkpoint_layout(config), read, read_ahead):
        index = layer_of.get(name)
        if pending is not None and index != pending:
            _finish_layer(model.layers[pending], pending, keep, layer_device)
            pending = None
        value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if value.shape != params[name].shape:
            raise UserError(
                f"malformed checkpoint: {sources[0]} has shape {tuple(value.shape)}, "
                f"expected {tuple(params[name].shape)}"
            )
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(value, False))
        pending = index
    if pending is not None:
        _finish_layer(model.layers[pending], pending, keep, layer_device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    inv_freq = inverse_frequencies(config.rope, config.head_dim).to(device)
    model.register_buffer("inv_freq", inv_freq, persistent=False)
    return model.eval()


def _on_current_gpu(device: str | torch.device) -> torch.device:
    """``device``, with a GPU of no index given the calling thread's current one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _in_order(layout: dict[str, list[str]], read: Callable, threads: int) -> Iterator[tuple]:
    """``(name, sources, read(name, sources))`` for each of ``layout`` in order; with
    ``threads``, read by that many threads, at most twice as many ahead of the one yielded
    (reading a file and copying it to the GPU overlap, and so do the copies of several)."""
    items = list(layout.items())
    if threads <= 0:
        for name, sources in items:
            yield name, sources, read(name, sources)
        return
    pool = ThreadPoolExecutor(threads, thread_name_prefix="headspace-load")
    try:
        ahead = [pool.submit(read, *item) for item in items[: 2 * threads]]
        for i, (name, sources) in enumerate(items):
            parts = ahead[i].result()
            ahead[i] = None  # placed: its tensors now belong to the model
            if i + 2 * threads < len(items):
                ahead.append(pool.submit(read, *items[i + 2 * threads]))
            yield name, sources, parts
    finally:  # on an error or an early stop, the reads not yet begun are dropped
        pool.shutdown(wait=True, cancel_futures=True)


def _finish_layer(layer: torch.nn.Module, index: int, keep, device) -> None:
    if keep is not None:
        keep(index, layer)
    layer.to(device)


def _safetensors_reader(files: Iterable[Path]) -> GetTensor:
    handles: dict[str, tuple[Path, object]] = {}
    for path in files:
        try:
            handle = safe_open(path, framework="pt")
            handles.update(dict.fromkeys(handle.keys(), (path, handle)))
        except (SafetensorError, OSError) as exc:
            raise UserError(f"corrupted safetensors file {path.name}: {exc}") from None

    def get_tensor(name: str) -> torch.Tensor:
        if name not in handles:
            raise UserError(f"malformed checkpoint: tensor {name} not found in safetensors files")
        path, handle = handles[name]
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise UserError(f"corrupted safetensors file {path.name}: {exc}") from None

    return get_tensor


def load_model(
    model_dir: Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    keep: Callable[[int, torch.nn.Module], None] | None = None,
    layer_device: str | torch.device | None = None,
) -> LlamaModel:
    """Load a Llama-family checkpoint directory (config.json + *.safetensors); ``keep`` and
    ``layer_device``: see :func:`build_model`."""
    config = load_config(model_dir)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UserError(f"model directory {model_dir} has no .safetensors weights")
    threads = min(8, os.cpu_count() or 1)
    return build_model(config, _safetensors_reader(files), device, dtype, keep, layer_device,
                       read_ahead=threads)  # fmt: skip
