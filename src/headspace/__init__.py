"""headspace: long-context LLM inference with head-wise KV placement."""

from headspace.api import LLM
from headspace.engine.engine import RequestOutput
from headspace.engine.sampling import SamplingParams
from headspace.errors import UserError

__all__ = ["LLM", "RequestOutput", "SamplingParams", "UserError"]
__version__ = "0.1.0"
