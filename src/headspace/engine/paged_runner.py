"""Runs the model over the paged pool: per-sequence chunked prefill, batched decode."""

from __future__ import annotations

import torch

from headspace.attention import attend
from headspace.attention.paged import (
    flex_paged_attention,
    gathered_paged_attention,
    physical_block_mask,
)
from headspace.engine.config import EngineConfig
from headspace.engine.scheduler import Sequence
from headspace.kv.block_table import BlockManager
from headspace.kv.paged_store import PagedKVStore
from headspace.model.llama import LlamaModel


class PagedRunner:
    """Steps the model for sequences whose K/V live in one shared page pool."""

    def __init__(self, model: LlamaModel, config: EngineConfig, num_pages: int, page_size: int):
        cfg = model.config
        self.model, self.config = model, config
        self.device = torch.device(config.device)
        self.page_size = page_size
        self.blocks = BlockManager(num_pages, page_size)
        self.store = PagedKVStore(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages, page_size,
            dtype=config.torch_dtype, device=self.device,
        )  # fmt: skip
        self._compiled = config.compile and self.device.type == "cuda"

    def _tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """Block tables ``[seqs, max_pages]`` int32 on the device (padded with page 0)."""
        pages = [self.blocks.table(s.seq_id).pages for s in seqs]
        table = torch.zeros(len(seqs), max(map(len, pages)), dtype=torch.int32)
        for row, seq_pages in enumerate(pages):
            table[row, : len(seq_pages)] = torch.tensor(seq_pages, dtype=torch.int32)
        return table.to(self.device)

    def _attention(self, tables, seq_lens, q_lens, slots, decode: bool):
        """The model's attention callback for a batch laid out as ``[seqs, q_lens]`` tokens."""
        num_seqs, max_q = len(seq_lens), int(q_lens.max())
        on_gpu = self.device.type == "cuda"
        mask, padded_q = None, max_q
        if on_gpu and not decode:  # queries padded to a power of two >= 128: few compiled shapes
            padded_q = max(128, 1 << (max_q - 1).bit_length())
            num_slots = self.store.num_pages * self.page_size
            mask = physical_block_mask(
                tables, seq_lens, q_lens, padded_q, num_slots, self.page_size
            )

        def attention(layer: int, q, kv):  # q [T, H, D], kv [2, T, Hkv, D]
            store_kv = self.store.kv[layer]
            if on_gpu and decode:
                from headspace.attention.triton_decode import paged_decode_attention

                out, _ = paged_decode_attention(q, store_kv[0], store_kv[1], tables, seq_lens,
                                                self.page_size, new_kv=kv)  # fmt: skip
                return out
            self.store.write(layer, slots, kv)
            q4 = q.view(num_seqs, max_q, *q.shape[1:]).transpose(1, 2)  # [B, H, Lq, D]
            if on_gpu:
                q4 = torch.nn.functional.pad(q4, (0, 0, 0, padded_q - max_q))
                out, _ = flex_paged_attention(q4, store_kv[0], store_kv[1], mask)
                out = out[:, :, :max_q]
            else:
                backend = self.config.attention_backend
                out, _ = gathered_paged_attention(
                    q4, store_kv, tables, seq_lens, q_lens, self.page_size,
                    lambda *a, **k: attend(*a, backend=backend, **k),
                )  # fmt: skip
            return out.transpose(1, 2).reshape(q.shape)

        return attention

    @torch.inference_mode()
    def prefill(self, seq: Sequence, chunk: int) -> torch.Tensor:
        """Compute the prompt tokens of ``seq`` not found in the prefix cache; last logits."""
        pages = torch.tensor(self.blocks.table(seq.seq_id).pages, device=self.device)
        tables = pages.to(torch.int32)[None]
        ids = torch.tensor(seq.prompt_ids, device=self.device)
        hidden = None
        for start in range(seq.num_cached, len(seq.prompt_ids), chunk):
            end = min(start + chunk, len(seq.prompt_ids))
            positions = torch.arange(start, end, device=self.device)
            seq_lens = torch.tensor([end], device=self.device)
            q_lens = torch.tensor([end - start], device=self.device)
            slots = self.store.slots(pages, positions)
            attention = self._attention(tables, seq_lens, q_lens, slots, decode=False)
            mode = "eager"
            if self._compiled:  # static shapes for full chunks (see ModelRunner)
                mode = "static" if end - start == chunk else "dynamic"
            hidden = self.model(ids[start:end], positions, attention, mode)
        self.blocks.cache_full_pages(seq.seq_id, seq.prompt_ids)
        return self.model.logits(hidden[-1:])[0]

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Append each sequence's last token; returns fp32 logits ``[seqs, vocab]``."""
        for seq in seqs:
            self.blocks.append_token(seq.seq_id)
        tokens = torch.tensor([s.token_ids[-1] for s in seqs], device=self.device)
        positions = torch.tensor([s.num_tokens - 1 for s in seqs], device=self.device)
        tables = self._tables(seqs)
        slots = tables.long().gather(1, (positions // self.page_size)[:, None])[:, 0]
        slots = slots * self.page_size + positions % self.page_size
        seq_lens, q_lens = positions + 1, torch.ones_like(positions)
        attention = self._attention(tables, seq_lens, q_lens, slots, decode=True)
        mode = "dynamic" if self._compiled else "eager"
        hidden = self.model(tokens, positions, attention, mode)
        for seq in seqs:
            self.blocks.cache_full_pages(seq.seq_id, seq.token_ids)
        return self.model.logits(hidden)
