"""Long-context evaluation: needle in a haystack, RULER-style tasks, perplexity."""
