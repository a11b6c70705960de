"""headspace: long-context LLM inference with head-wise KV placement.

The names below load on first use, so that the pure layers (``headspace.planner``, the
solvers of ``headspace.parallel``) import without torch.
"""

import os

from headspace.lazy import lazy_names

# The GPU budget counts what the engine allocates; the caching allocator's fixed-size segments
# reserved up to 2.5 GiB more than that in a 24 GiB budget (freed gathers and pieces of
# varying sizes). Segments that grow in place keep the reservation near the allocations.
# Read at the first CUDA allocation; a user's own setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

__all__ = ["LLM", "RequestOutput", "SamplingParams", "UserError"]
__version__ = "0.1.0"

_HOMES = {
    "LLM": "headspace.api",
    "RequestOutput": "headspace.engine.outputs",
    "SamplingParams": "headspace.engine.sampling",
    "UserError": "headspace.errors",
}

__getattr__ = lazy_names(__name__, _HOMES)
