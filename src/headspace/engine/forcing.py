"""Logits of given tokens (teacher forcing), for scoring: a prompt through the paged prefill
path, then the rest through decode steps fed the given tokens, so that they run what
generation runs (the hybrid tier, its sparse mode, KV budgets)."""

from __future__ import annotations

import torch

from headspace.engine.paged_runner import PagedRunner
from headspace.engine.step_plan import Sequence
from headspace.errors import UserError
from headspace.kv.block_table import BlockManager
from headspace.kv.page_pool import OutOfPages


def forced_logits(runner: PagedRunner, blocks: BlockManager, tiers: tuple[str, ...],
                  seq: Sequence, token_ids: list[int], chunk: int) -> torch.Tensor:  # fmt: skip
    """fp32 logits ``[len(token_ids), vocab]`` (CPU): ``seq``'s prompt (the first tokens of
    ``token_ids``) prefilled ``chunk`` at a time in ``tiers`` of ``blocks``, each later token
    through a decode step fed it. The runner must be laid out for ``seq``; its pages are
    freed after."""
    try:
        blocks.allocate_prompt(seq.seq_id, seq.prompt_ids, tiers, reuse=False)
    except OutOfPages:
        raise UserError(f"{len(token_ids)} tokens do not fit the KV pool") from None
    try:
        pages = blocks.pages([seq.seq_id])
        rows = [runner.prefill(seq, chunk, pages, all_logits=True)]  # [prompt tokens, vocab]
        blocks.cache_full_pages(seq.seq_id, seq.prompt_ids)
        for position in range(len(seq.prompt_ids), len(token_ids)):
            blocks.append_token(seq.seq_id)
            runner.tokens[0].fill_(token_ids[position])  # (queued: a number into one element waits)
            logits, _ = runner.decode([seq.seq_id], [position], [0], pages)
            rows.append(logits.float().cpu())
        return torch.cat(rows)
    finally:
        runner.forget(seq.seq_id)  # what the tiers keep of it (the sparse mode's queries)
        blocks.free(seq.seq_id)
