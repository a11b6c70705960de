"""headspace: long-context LLM inference with head-wise KV placement."""

import os

# The GPU budget counts what the engine allocates; the caching allocator's fixed-size segments
# reserved up to 2.5 GiB more than that in a 24 GiB budget (freed gathers and pieces of
# varying sizes). Segments that grow in place keep the reservation near the allocations.
# Read at the first CUDA allocation; a user's own setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from headspace.api import LLM
from headspace.engine.engine import RequestOutput
from headspace.engine.sampling import SamplingParams
from headspace.errors import UserError

__all__ = ["LLM", "RequestOutput", "SamplingParams", "UserError"]
__version__ = "0.1.0"
