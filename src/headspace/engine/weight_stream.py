"""Decoder layers streamed from pinned host memory (FlexAttn's CPIP): each layer's weights
sit in one flat pinned buffer; ``depth`` device slots take them in turn, layer l+1 copied
on a side stream while layer l computes. The model stays unaware: it iterates
``model.layer_source`` (this object) instead of its own layers, and each layer it gets
is a stand-in whose parameters are views into the slot that holds it.

On the CPU (tests) the copies are plain synchronous copies into the slots: the same
schedule, packing and views, so the CPU twin checks everything but the overlap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from headspace.engine.memory import gpu_budget
from headspace.errors import UserError
from headspace.kv.host_store import page_lock
from headspace.model.llama import DecoderLayer, LlamaModel
from headspace.parallel.dist import all_agree
from headspace.planner.memory import STREAM_DEPTH, streams_weights

ALIGN_BYTES = 256  # each parameter's view starts on this boundary (aligned GEMM operands)


def _offsets(layer: nn.Module) -> tuple[dict[str, tuple[int, torch.Size]], int]:
    """Each parameter's (element offset, shape) in the layer's flat buffer, and its length."""
    offsets, numel = {}, 0
    for name, param in layer.named_parameters():
        align = ALIGN_BYTES // param.element_size()
        numel = -(-numel // align) * align
        offsets[name] = (numel, param.shape)
        numel += param.numel()
    return offsets, numel


def _set_views(layer: nn.Module, flat: torch.Tensor, offsets: dict) -> None:
    """Point ``layer``'s parameters at views of ``flat`` (the same names, shapes)."""
    for name, (start, shape) in offsets.items():
        module_name, _, attr = name.rpartition(".")
        view = flat[start : start + shape.numel()].view(shape)
        setattr(layer.get_submodule(module_name), attr, nn.Parameter(view, requires_grad=False))


def _stand_in(layer: DecoderLayer, slot: torch.Tensor, offsets: dict) -> DecoderLayer:
    """A layer like ``layer`` (its shape, its ``reduce``, its biases or none) whose
    parameters are views into ``slot``."""
    stand_in = DecoderLayer.__new__(DecoderLayer)
    nn.Module.__init__(stand_in)
    for name, module in layer.named_children():
        clone = module.__class__.__new__(module.__class__)
        clone.__dict__ = {**module.__dict__, "_parameters": dict(module._parameters)}
        stand_in.add_module(name, clone)
    stand_in.shape, stand_in.reduce = layer.shape, layer.reduce
    _set_views(stand_in, slot, offsets)
    return stand_in


class WeightStream:
    """The decoder layers of ``model`` in pinned host memory, streamed through ``depth``
    device slots. Iterating yields each layer ready on the device, in order; the next
    layers' copies are already under way. Non-layer weights move to ``device``.

    ``delay``: a test's hook (``EngineHooks.weight_delay``; None: none), called as
    ``delay("copy", layer)`` on the copy stream just before each layer's copy into its slot
    is issued, and ``delay("layer", layer)`` on the compute stream just before each layer
    is handed to the model (e.g. ``torch.cuda._sleep`` there makes one side late)."""

    def __init__(self, model: LlamaModel, device: torch.device | str, depth: int = STREAM_DEPTH,
                 delay: Callable[[str, int], None] | None = None):  # fmt: skip
        if model.layer_source is not None:
            raise UserError("this model's layers already stream for another engine; "
                            "build or load the model again")  # fmt: skip
        self.device = torch.device(device)
        self.depth = depth = min(depth, len(model.layers))
        self.delay = delay
        on_gpu = self.device.type == "cuda"
        self.host: list[torch.Tensor] = []  # [layer] flat page-locked weights
        layouts, was_on_gpu = [], False
        for layer in model.layers:
            offsets, numel = _offsets(layer)
            dtype = next(layer.parameters()).dtype
            flat = torch.empty(numel, dtype=dtype)  # locked below at its exact size
            for name, param in layer.named_parameters():
                start, shape = offsets[name]
                flat[start : start + shape.numel()].copy_(param.detach().reshape(-1))
                was_on_gpu |= param.device.type == "cuda"
            _set_views(layer, flat, offsets)  # the host copy is the only copy
            if on_gpu:
                page_lock(flat, "streamed weights", "give the weights GPU room (--weights gpu), or")
            self.host.append(flat)
            layouts.append(offsets)
        for name, param in model.named_parameters():  # embeddings, norm, LM head
            if not name.startswith("layers.") and param.device != self.device:
                param.data = param.data.to(self.device)
        model.inv_freq = model.inv_freq.to(self.device)
        align = ALIGN_BYTES // self.host[0].element_size()  # every slot starts aligned
        width = -(-max(flat.numel() for flat in self.host) // align) * align
        self.slots = torch.empty(depth, width, dtype=self.host[0].dtype, device=self.device)
        self.layers = [_stand_in(layer, self.slots[i % depth], layouts[i])
                       for i, layer in enumerate(model.layers)]  # fmt: skip
        self.copy_stream = torch.cuda.Stream(self.device) if on_gpu else None
        if on_gpu:  # the last prefetch may still write the slots when they are freed
            self.slots.record_stream(self.copy_stream)
        if was_on_gpu:  # the layers' device memory, back to the budget's free bytes
            torch.cuda.empty_cache()
        self._holds = [-1] * depth  # [slot] the layer whose copy was last issued into it
        self._ready = [None] * depth  # [slot] its copy's event
        self._free = [None] * depth  # [slot] the event after the last layer computed in it
        model.layer_source = self

    @property
    def device_bytes(self) -> int:
        """Bytes of the device slots."""
        return self.slots.nbytes

    @property
    def host_bytes(self) -> int:
        return sum(flat.nbytes for flat in self.host)

    def _fetch(self, index: int) -> None:
        """Copy layer ``index`` into its slot, after the slot's last layer has computed."""
        slot = index % self.depth
        if self._holds[slot] == index:
            return
        flat, target = self.host[index], self.slots[slot, : self.host[index].numel()]
        self._holds[slot] = index
        if self.copy_stream is None:
            if self.delay is not None:
                self.delay("copy", index)
            target.copy_(flat)
            return
        with torch.cuda.stream(self.copy_stream):
            if self._free[slot] is not None:
                self.copy_stream.wait_event(self._free[slot])
            if self.delay is not None:
                self.delay("copy", index)
            target.copy_(flat, non_blocking=True)
            self._ready[slot] = torch.cuda.Event()
            self._ready[slot].record(self.copy_stream)

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[DecoderLayer]:
        num_layers, compute = len(self.layers), None
        if self.copy_stream is not None:  # the stream the layers compute on
            compute = torch.cuda.current_stream(self.device)
        for index in range(num_layers):
            for ahead in range(min(self.depth, num_layers - index)):  # this and the next ones
                self._fetch(index + ahead)
            slot = index % self.depth
            if compute is not None:
                compute.wait_event(self._ready[slot])
            if self.delay is not None:
                self.delay("layer", index)
            try:
                yield self.layers[index]
            finally:  # the slot is free once this layer's work (even a failed pass's) ends
                if compute is not None:
                    self._free[slot] = torch.cuda.Event()
                    self._free[slot].record(compute)
        for index in range(self.depth):  # the next pass's first layers, while this one ends
            self._fetch(index)


def weights_streamed(model_config, config, ranks=None, on_device_bytes: int = 0) -> bool:
    """Whether decoder layers stream from host memory (``config.cache.weights``; with "auto"
    when resident weights leave no room for KV in the GPU budget, which ``on_device_bytes`` of
    weights already on the device count toward; never on the CPU). Under torchrun every
    rank decides alike: all stream if one must."""
    budget = gpu_budget(config, on_device_bytes) if config.runtime.on_gpu else None
    shard = {} if ranks is None else {"world": ranks.layout.world, "kv_heads": ranks.most_heads}
    runtime = config.runtime
    streamed = streams_weights(config.cache.weights, model_config, budget,
                               runtime.torch_dtype.itemsize, runtime.max_batch,
                               runtime.prefill_chunk, **shard)  # fmt: skip
    if ranks is not None and config.cache.weights == "auto":
        streamed = not all_agree(not streamed)
    return streamed


def device_weight_bytes(model: LlamaModel) -> int:
    """Bytes the model's weights take on its device: all of them, or with streamed layers
    the embeddings, final norm and LM head beside the layer slots."""
    stream = model.layer_source
    if not isinstance(stream, WeightStream):
        return sum(p.nbytes for p in model.parameters())
    others = sum(p.nbytes for name, p in model.named_parameters() if not name.startswith("layers."))
    return others + stream.device_bytes


def streamed_weight_bytes(model: LlamaModel) -> int:
    """Bytes copied from host memory per forward pass (0 with resident layers)."""
    stream = model.layer_source
    return stream.host_bytes if isinstance(stream, WeightStream) else 0
