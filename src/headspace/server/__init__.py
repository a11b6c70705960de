"""The OpenAI-compatible server: ``headspace serve`` (see docs/serving.md)."""
