"""Runs the model over the KV cache: chunked prefill and a graph-captured decode step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from headspace.attention import attend, decode_attend
from headspace.engine.config import EngineConfig
from headspace.kv.contiguous import ContiguousKVCache
from headspace.model.llama import LlamaModel

CAPACITY_STEP = 1024  # cache capacity is rounded up to this many tokens, so graphs get reused
CPU_PREFILL_CHUNK = 1024
MAX_GPU_PREFILL_CHUNK = 32768


class ModelRunner:
    """Owns the KV cache of the current sequence and steps the model over it."""

    def __init__(self, model: LlamaModel, config: EngineConfig):
        self.model = model
        self.config = config
        self.device = torch.device(config.device)
        self.cache: ContiguousKVCache | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._token = torch.zeros(1, dtype=torch.long, device=self.device)
        self._position = torch.zeros(1, dtype=torch.long, device=self.device)
        self._length = torch.ones(1, dtype=torch.long, device=self.device)
        self._logits: torch.Tensor | None = None
        self._compiled = config.compile and self.device.type == "cuda"

    # -- cache -------------------------------------------------------------------------
    def reserve(self, num_tokens: int) -> None:
        """Make the cache hold ``num_tokens``; reuses the current one (and its graph) if it can."""
        if self.cache is not None and self.cache.capacity >= num_tokens:
            return
        self.release()
        cfg = self.model.config
        capacity = -(-num_tokens // CAPACITY_STEP) * CAPACITY_STEP
        self.cache = ContiguousKVCache(
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            capacity,
            dtype=self.config.torch_dtype,
            device=self.device,
        )
        if self.device.type == "cuda" and self.config.cuda_graph:
            self._capture_decode_graph()

    def release(self) -> None:
        """Free the cache and the decode graph that points into it."""
        self.cache, self._graph, self._logits = None, None, None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def prefill_chunk_size(self) -> int:
        """Prompt tokens per prefill step: the user's choice, else what fits the device."""
        if self.config.prefill_chunk:
            return self.config.prefill_chunk
        if self.device.type != "cuda":
            return CPU_PREFILL_CHUNK
        cfg = self.model.config
        per_token = 2 * (6 * cfg.hidden_size + 3 * cfg.intermediate_size)  # activations, bytes
        per_token += 4 * cfg.num_heads * cfg.head_dim * 2  # q/out copies and expanded k/v
        free, _ = torch.cuda.mem_get_info(self.device)
        fit = int(0.5 * free) // per_token
        # a power of two, so full chunks share one compiled shape across prompts
        return max(1024, min(1 << max(fit, 1).bit_length() - 1, MAX_GPU_PREFILL_CHUNK))

    def _blocks_mode(self, full: bool) -> str:
        """Compiled blocks on GPU: static shapes for the decode step and full chunks."""
        if not self._compiled:
            return "eager"
        return "static" if full else "dynamic"

    # -- prefill -----------------------------------------------------------------------
    def _prefill_attention(self, start: int) -> Callable:
        def attention(layer: int, q, kv):  # q [T, H, D], kv [2, T, Hkv, D]
            self.cache.write(layer, start, kv)
            k_all, v_all = self.cache.view(layer, start + q.shape[0])
            backend = self.config.attention_backend
            out, _ = attend(q.transpose(0, 1), k_all, v_all, causal=True, backend=backend)
            return out.transpose(0, 1)

        return attention

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: torch.Tensor,  # [tokens] int64, the whole sequence so far
        start: int = 0,
        *,
        all_logits: bool = False,
        on_chunk: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run ``token_ids[start:]`` through the model in chunks, appending to the cache.

        Returns fp32 logits ``[tokens - start, vocab]`` on the CPU when ``all_logits``, else
        the last token's logits ``[vocab]`` on the device. ``on_chunk(n)`` reports progress.
        """
        num_tokens = token_ids.shape[0]
        self.reserve(num_tokens)
        chunk = self.prefill_chunk_size()
        rows, hidden = [], None
        for chunk_start in range(start, num_tokens, chunk):
            chunk_end = min(chunk_start + chunk, num_tokens)
            ids = token_ids[chunk_start:chunk_end].to(self.device)
            positions = torch.arange(chunk_start, chunk_end, device=self.device)
            attention = self._prefill_attention(chunk_start)
            mode = self._blocks_mode(full=chunk_end - chunk_start == chunk)
            hidden = self.model(ids, positions, attention, mode)
            if all_logits:
                rows.append(self.model.logits(hidden).cpu())
            if on_chunk:
                on_chunk(chunk_end - chunk_start)
        if all_logits:
            return torch.cat(rows)
        return self.model.logits(hidden[-1:])[0]

    # -- decode ------------------------------------------------------------------------
    def _decode_attention(self, layer: int, q, kv):  # q [1, H, D], kv [2, 1, Hkv, D]
        k_all, v_all = self.cache.view(layer)  # the kernel appends kv at position length-1
        out, _ = decode_attend(q.transpose(0, 1), k_all, v_all, self._length, new_kv=kv)
        return out.transpose(0, 1)

    def _decode_step(self) -> torch.Tensor:
        torch.add(self._position, 1, out=self._length)
        mode = self._blocks_mode(full=True)
        hidden = self.model(self._token, self._position, self._decode_attention, mode)
        return self.model.logits(hidden)[0]

    @torch.inference_mode()
    def _capture_decode_graph(self) -> None:
        # Warm-up writes K/V at position 0 of a fresh cache; prefill overwrites it.
        self._position.zero_()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._decode_step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._logits = self._decode_step()
        self._graph = graph

    @torch.inference_mode()
    def decode(self, token: torch.Tensor | int, position: int) -> torch.Tensor:
        """Append one token at ``position``; returns its fp32 logits ``[vocab]`` on the device.

        The returned tensor is overwritten by the next call.
        """
        assert self.cache is not None and position < self.cache.capacity
        self._token.copy_(torch.as_tensor(token).reshape(1))
        self._position.fill_(position)
        if self._graph is None:
            return self._decode_step()
        self._graph.replay()
        return self._logits
