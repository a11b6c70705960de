"""Engine options shared by the API and the CLI."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headspace.errors import UserError
from headspace.planner.plan import OFFLOAD_MODES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """How the engine runs a model.

    ``prefill_chunk``: prompt tokens per prefill step (None: as many as fit the device).
    ``max_context``: longest sequence allowed (None: the model's trained context).
    ``cuda_graph`` / ``compile``: capture the decode step in a CUDA graph / fuse its
    elementwise work with torch.compile (GPU only).
    ``gpu_memory``: memory budget of the engine on its device ("24GiB", "500MB", a fraction
    such as 0.8, or None for most of what is free); the KV page pool gets what weights and
    activations leave; ``num_kv_pages`` sets the pool size directly instead.
    ``page_size``: tokens per KV page. ``max_batch``: most sequences decoded together.
    ``prefix_caching``: reuse the pages of a prompt prefix seen before.
    ``offload``: "auto" (stream kv heads from host memory only when the context does not
    fit ``gpu_memory``), "none", "layer" (whole layers) or "head" (head groups of
    ``head_group`` kv heads, None: chosen by the planner); ``host_memory`` bounds the host
    side (None: 90% of the host memory available). Streaming serves one sequence at a time.
    """

    device: str = "cpu"
    dtype: str | None = None
    prefill_chunk: int | None = None
    max_context: int | None = None
    attention_backend: str = "sdpa"
    cuda_graph: bool = True
    compile: bool = True
    progress: bool = False
    gpu_memory: str | float | None = None
    num_kv_pages: int | None = None
    page_size: int = 128
    max_batch: int = 64
    prefix_caching: bool = True
    offload: str = "auto"
    head_group: int | None = None
    host_memory: str | float | None = None

    def __post_init__(self):
        if self.dtype is None:
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.dtype not in DTYPES:
            raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise UserError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"device {self.device!r} requested but no CUDA GPU is available")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise UserError(f"prefill_chunk must be a positive integer, got {self.prefill_chunk}")
        if self.max_context is not None and self.max_context < 1:
            raise UserError(f"max_context must be a positive integer, got {self.max_context}")
        if self.offload not in OFFLOAD_MODES:
            raise UserError(
                f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {self.offload!r}"
            )
        if self.head_group is not None and self.head_group < 1:
            raise UserError(f"head_group must be a positive integer, got {self.head_group}")
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            raise UserError(f"num_kv_pages must be a positive integer, got {self.num_kv_pages}")
        for name in ("page_size", "max_batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.attention_backend not in ("sdpa", "reference"):
            raise UserError(
                f"attention_backend must be 'sdpa' or 'reference', got {self.attention_backend!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")
