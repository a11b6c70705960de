"""The command line's subcommands and their one-line help: ``headspace --help`` and
``--version`` are answered from here alone, without importing torch."""

from __future__ import annotations

COMMAND_HELP = {
    "generate": "generate text from a prompt (streams to stdout)",
    "plan": "print the head map and memory plan for a context",
    "eval": "needle in a haystack, RULER-style tasks, perplexity",
    "profile": "per-head retrieval scores and pattern costs",
    "serve": "serve the model over an OpenAI-compatible HTTP API",
}

__all__ = ["COMMAND_HELP"]
