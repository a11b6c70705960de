"""Runs the model over the paged pool: per-sequence chunked prefill, batched decode."""

from __future__ import annotations

import torch

from headspace.attention import attend, merge_attention, reference_attention
from headspace.attention.paged import flex_paged_attention, gather_pages, prefix_block_mask
from headspace.engine.config import EngineConfig
from headspace.engine.offload import HeadStreamer
from headspace.engine.scheduler import Sequence
from headspace.kv.block_table import BlockManager
from headspace.kv.host_store import HostKVStore
from headspace.kv.paged_store import PagedKVStore
from headspace.model.llama import LlamaModel
from headspace.planner.head_map import HeadMap


class PagedRunner:
    """Steps the model for sequences whose K/V live in one shared page pool."""

    def __init__(self, model: LlamaModel, config: EngineConfig, num_pages: int, page_size: int,
                 head_map: HeadMap | None = None, head_group: int = 1):  # fmt: skip
        cfg = model.config
        self.model, self.config = model, config
        self.device = torch.device(config.device)
        self.page_size = page_size
        self.blocks = BlockManager(num_pages, page_size)
        self.head_map = head_map or HeadMap.all_gpu(cfg.num_layers, cfg.num_kv_heads)
        self._resident = [self.head_map.heads(layer, "gpu") for layer in range(cfg.num_layers)]
        self.store = PagedKVStore(  # one extra page: the scratch page of padded graph rows
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages + 1, page_size,
            dtype=config.torch_dtype, device=self.device,
            heads_per_layer=[len(heads) for heads in self._resident],
        )  # fmt: skip
        self._compiled = config.compile and self.device.type == "cuda"
        self._graphs, self.streamer, self._parts = None, None, []
        if self.head_map.count("stream"):
            self.streamer = self._make_streamer(num_pages * page_size, head_group)
            self._parts = [self._layer_parts(layer) for layer in range(cfg.num_layers)]
        elif self.device.type == "cuda" and config.cuda_graph:
            from headspace.engine.paged_graphs import DecodeGraphs

            mode = "static" if self._compiled else "eager"
            self._graphs = DecodeGraphs(model, self.store, page_size, num_pages, mode)

    def _make_streamer(self, capacity: int, head_group: int) -> HeadStreamer:
        """Host store and streamer of the head map's streamed entries (one sequence)."""
        cfg, dtype = self.model.config, self.config.torch_dtype
        streamed = [(e.layer, e.kv_head) for e in self.head_map.entries if e.tier == "stream"]
        host = HostKVStore(streamed, capacity, cfg.head_dim, dtype=dtype,
                           pin=self.device.type == "cuda")  # fmt: skip
        return HeadStreamer(self.head_map, host, head_group, capacity, cfg.head_dim, dtype=dtype,
                            device=self.device, backend=self.config.attention_backend)  # fmt: skip

    def _layer_parts(self, layer: int) -> list[tuple[list[int] | None, torch.Tensor, torch.Tensor]]:
        """How ``layer``'s heads split: (None for the resident kv heads, else a streamed
        group; query-head index; kv-head index), indices on the device once (indexing with
        a Python list copies it to the GPU and waits, every layer)."""
        per_kv = self.model.config.num_queries_per_kv
        resident = self._resident[layer]
        splits = [(None, resident)] if resident else []
        splits += [(group, group) for group in self.head_map.stream_groups(layer)]
        parts = []
        for group, kv_heads in splits:
            q_heads = [h * per_kv + i for h in kv_heads for i in range(per_kv)]
            parts.append((group, torch.tensor(q_heads, device=self.device),
                          torch.tensor(kv_heads, device=self.device)))  # fmt: skip
        return parts

    def _split_heads(self, layer: int, q, kv, resident_fn):
        """Resident kv heads through ``resident_fn(q, kv)``, streamed groups through the
        streamer; ``q [T, H, D]``, ``kv [2, T, Hkv, D]`` -> ``[T, H, D]``."""
        if self.streamer is None:
            return resident_fn(q, kv)
        out = torch.empty_like(q)
        for group, q_index, kv_index in self._parts[layer]:
            q_part, kv_part = q[:, q_index], kv[:, :, kv_index]
            if group is None:
                out[:, q_index] = resident_fn(q_part, kv_part)
            else:
                out[:, q_index] = self.streamer.attend(layer, group, q_part, kv_part)
        return out

    # -- prefill -----------------------------------------------------------------------
    def _prefix_part(self, layer: int, q: torch.Tensor, pages: torch.Tensor, prefix: int):
        """Attention of chunk queries ``q [H, T, D]`` to the ``prefix`` tokens in the pool."""
        store_kv = self.store.kv[layer]
        if self.device.type != "cuda":  # the CPU twin: gather the pages, dense attention
            k, v = gather_pages(store_kv, pages, prefix, self.page_size)
            return attend(q, k, v, backend=self.config.attention_backend)
        num_q = q.shape[1]
        padded = max(128, 1 << (num_q - 1).bit_length())  # few compiled query shapes
        num_slots = self.store.num_pages * self.page_size
        mask = prefix_block_mask(pages, prefix, padded, num_slots, self.page_size)
        q4 = torch.nn.functional.pad(q, (0, 0, 0, padded - num_q))[None]
        out, lse = flex_paged_attention(q4, store_kv[0], store_kv[1], mask)
        return out[0, :, :num_q], lse[0, :, :num_q]

    def _prefill_attention(self, pages: torch.Tensor, start: int, slots: torch.Tensor):
        """Chunk at ``start``: causal attention over its own K/V (fused SDPA, cuDNN on GPU)
        merged by LSE with attention over the prefix pages (FlexAttention on GPU)."""

        def resident(layer: int, q, kv):  # q [T, H, D], kv [2, T, Hkv, D]
            self.store.write(layer, slots, kv)
            q_heads = q.transpose(0, 1)
            k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)
            backend = self.config.attention_backend
            out, lse = attend(q_heads, k, v, causal=True, backend=backend)
            if start > 0:
                prefix_out, prefix_lse = self._prefix_part(layer, q_heads, pages, start)
                out, lse = merge_attention([out, prefix_out], [lse, prefix_lse])
            return out.transpose(0, 1)

        def attention(layer: int, q, kv):
            return self._split_heads(layer, q, kv, lambda q, kv: resident(layer, q, kv))

        return attention

    @torch.inference_mode()
    def prefill(
        self, seq: Sequence, chunk: int, *, all_logits: bool = False, on_chunk=None
    ) -> torch.Tensor:
        """Compute the prompt tokens of ``seq`` not found in the prefix cache.

        Returns the last token's fp32 logits ``[vocab]`` on the device, or with
        ``all_logits`` those of every computed token ``[tokens, vocab]`` on the CPU.
        ``on_chunk(n)`` reports progress.
        """
        pages = torch.tensor(self.blocks.table(seq.seq_id).pages, device=self.device)
        ids = torch.tensor(seq.prompt_ids, device=self.device)
        hidden, rows = None, []
        for start in range(seq.num_cached, len(seq.prompt_ids), chunk):
            end = min(start + chunk, len(seq.prompt_ids))
            positions = torch.arange(start, end, device=self.device)
            attention = self._prefill_attention(pages, start, self.store.slots(pages, positions))
            if self.streamer is not None:
                self.streamer.begin(start)
            mode = "eager"
            if self._compiled:  # static shapes for full chunks: one compile per chunk size
                mode = "static" if end - start == chunk else "dynamic"
            hidden = self.model(ids[start:end], positions, attention, mode)
            if all_logits:
                rows.append(self.model.logits(hidden).cpu())
            if on_chunk:
                on_chunk(end - start)
        self.blocks.cache_full_pages(seq.seq_id, seq.prompt_ids)
        return torch.cat(rows) if all_logits else self.model.logits(hidden[-1:])[0]

    # -- decode ------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Append each sequence's last token; returns fp32 logits ``[seqs, vocab]``."""
        for seq in seqs:
            self.blocks.append_token(seq.seq_id)
        pages = [self.blocks.table(s.seq_id).pages for s in seqs]
        tokens = [s.token_ids[-1] for s in seqs]
        positions = [s.num_tokens - 1 for s in seqs]
        if self._graphs is not None:
            logits = self._graphs.run(tokens, positions, pages)
        else:
            logits = self._eager_decode(tokens, positions, pages)
        for seq in seqs:
            self.blocks.cache_full_pages(seq.seq_id, seq.token_ids)
        return logits

    def _eager_decode(self, tokens: list[int], positions: list[int], pages: list[list[int]]):
        """The decode step without a graph: Triton over pages on GPU, gathered twin on CPU."""
        pos = torch.tensor(positions, device=self.device)
        tables = torch.zeros(len(pages), max(map(len, pages)), dtype=torch.int32)
        for row, seq_pages in enumerate(pages):
            tables[row, : len(seq_pages)] = torch.tensor(seq_pages, dtype=torch.int32)
        tables, lengths = tables.to(self.device), pos + 1
        on_gpu = self.device.type == "cuda"
        if not on_gpu:  # one slot per sequence, where its new token goes
            page = tables.long().gather(1, (pos // self.page_size)[:, None])[:, 0]
            slots = page * self.page_size + pos % self.page_size

        def resident(layer: int, q, kv):  # q [B, H, D], kv [2, B, Hkv, D]
            store_kv = self.store.kv[layer]
            if on_gpu:  # the kernel appends the new K/V itself
                from headspace.attention.triton_decode import paged_decode_attention

                return paged_decode_attention(q, store_kv[0], store_kv[1], tables, lengths,
                                              self.page_size, new_kv=kv)[0]  # fmt: skip
            self.store.write(layer, slots, kv)
            rows = []
            for b in range(q.shape[0]):
                k, v = gather_pages(store_kv, tables[b], positions[b] + 1, self.page_size)
                rows.append(reference_attention(q[b][:, None], k, v)[0][:, 0])
            return torch.stack(rows)

        def attention(layer: int, q, kv):
            return self._split_heads(layer, q, kv, lambda q, kv: resident(layer, q, kv))

        if self.streamer is not None:
            assert len(tokens) == 1, "streamed heads serve one sequence at a time"
            self.streamer.begin(positions[0])
        mode = "dynamic" if self._compiled else "eager"
        ids = torch.tensor(tokens, device=self.device)
        return self.model.logits(self.model(ids, pos, attention, mode))
