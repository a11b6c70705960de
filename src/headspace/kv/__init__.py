"""KV storage: bookkeeping (no tensors) and the modules that own device or host memory."""
