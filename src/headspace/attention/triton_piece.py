"""A prompt piece's causal attention over its sequence's pages in Triton, with every length a
device value: one kernel that a captured CUDA graph replays for any prefix.

A piece is ``rows`` prompt tokens at positions ``start .. start + rows - 1`` of one sequence,
whose K/V (the piece's own included) are already in the page pool. Query row ``i`` attends
keys ``0 .. start + i``. ``start`` and ``rows`` are read from device tensors, and the grid is
sized by the query buffer's row count (a bucket), so a graph captured once for a bucket
serves every piece that fits it: the eager path's fused kernels (the causal block, then the
prefix gathered from the pages in pieces and merged) take their lengths as shapes, and a
graph of them would hold one prefix only. Each program takes ``BLOCK_Q`` query tokens and
every query head of one kv head (GQA: the group's heads stacked as rows of one tile, so each
K/V block is read once for all of them). Runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from headspace.attention.triton_decode import LOG2E, _attend_keys

BLOCK_Q = 16  # query tokens a program takes (times the group's heads: the tile's rows)
BLOCK_N = 64  # keys a step of a program's loop


@triton.jit
def _piece_block(q, k_base, v_base, TABLE, block_start, end, key_limit, m_i, l_i, acc,
                 stride_kt, stride_vt, scale_log2, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Keys ``block_start .. +BLOCK_N`` (those before ``end``) added to each row's running
    softmax, row ``r`` seeing keys up to ``key_limit[r]``: ``(m_i, l_i, acc)``, base 2."""
    offs_n = block_start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < end
    # int64: a pool's plane may pass 2^31 elements
    if BLOCK_N <= PAGE_SIZE:  # a block within one page: its keys' addresses are contiguous
        # (a gathered page a key held 255 registers a thread and spilled, on sm_90)
        page = tl.load(TABLE + block_start // PAGE_SIZE).to(tl.int64)
    else:  # pages smaller than a block (a test's): a page a key
        page = tl.load(TABLE + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    slots = page * PAGE_SIZE + offs_n % PAGE_SIZE
    visible = n_ok[None, :] & (offs_n[None, :] <= key_limit[:, None])
    return _attend_keys(q, k_base, v_base, slots, n_ok, visible, m_i, l_i, acc, stride_kt,
                        stride_vt, scale_log2, DIM, PRECISION)  # fmt: skip


@triton.jit
def _piece_kernel(
    Q, K, V, TABLE, START, ROWS, OUT, LSE, scale_log2,
    stride_qt, stride_qh, stride_kh, stride_kt, stride_vh, stride_vt, stride_ot, stride_oh,
    stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, WHILE_LOOP: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    start = tl.load(START)
    rows = tl.load(ROWS)
    first_token = q_block * BLOCK_Q
    if first_token < rows:  # (blocks of padding rows compute nothing)
        offs_m = tl.arange(0, BLOCK_Q * GROUP_PAD)  # a tile row: (token, head of the group)
        token = first_token + offs_m // GROUP_PAD
        heads = kv_head * GROUP + offs_m % GROUP_PAD
        row_ok = (offs_m % GROUP_PAD < GROUP) & (token < rows)
        offs_d = tl.arange(0, DIM)
        q = tl.load(Q + token[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)  # fmt: skip
        key_limit = start + token  # the last key each row sees (its own position)
        end = start + tl.minimum(first_token + BLOCK_Q, rows)  # keys this block needs
        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM], tl.float32)
        k_base = K + kv_head * stride_kh
        v_base = V + kv_head * stride_vh
        if WHILE_LOOP:  # (the interpreter ranges over no run-time bounds)
            block_start = 0
            while block_start < end:
                m_i, l_i, acc = _piece_block(
                    q, k_base, v_base, TABLE, block_start, end, key_limit, m_i, l_i, acc,
                    stride_kt, stride_vt, scale_log2, DIM, PAGE_SIZE, BLOCK_N, PRECISION,
                )  # fmt: skip
                block_start += BLOCK_N
        else:
            for block_start in tl.range(0, end, BLOCK_N):
                m_i, l_i, acc = _piece_block(
                    q, k_base, v_base, TABLE, block_start, end, key_limit, m_i, l_i, acc,
                    stride_kt, stride_vt, scale_log2, DIM, PAGE_SIZE, BLOCK_N, PRECISION,
                )  # fmt: skip
        has_keys = l_i > 0
        out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
        lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) / 1.4426950408889634,
                       float("-inf"))  # fmt: skip
        o_ptrs = OUT + token[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + heads * stride_lh + token, lse, mask=row_ok)


def paged_piece_attention(
    q: torch.Tensor,  # [tokens, heads, dim]: the piece's queries (a bucket's rows)
    k: torch.Tensor,  # [kv_heads, slots, dim]: the page pool (slot = page * page_size + offset)
    v: torch.Tensor,
    table: torch.Tensor,  # [pages] int32: the sequence's pages in logical order
    start: torch.Tensor,  # [1] int: the piece's first position (device tensor)
    rows: torch.Tensor,  # [1] int: the piece's tokens, at most q's rows (device tensor)
    page_size: int,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,  # [tokens, heads, dim]: receives the result in place
    num_warps: int = 8,  # (4 warps spilled a tile of 64 rows on sm_90: 255 registers a thread)
    num_stages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a prompt piece over its sequence's pages: ``out [tokens, heads,
    dim]`` in q's dtype and the natural-log ``lse [heads, tokens]`` in fp32. Row ``i <
    rows`` attends keys ``0 .. start + i`` (the piece's own K/V must be in the pages); rows
    past ``rows`` are left as they were (padding). The table's pages past the last key are
    never read."""
    num_tokens, num_heads, dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and q.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    lse = torch.empty(num_heads, num_tokens, device=q.device, dtype=torch.float32)
    scale = dim**-0.5 if scale is None else scale
    group_pad = triton.next_power_of_2(group)
    block_n = BLOCK_N if q.dtype != torch.float32 else BLOCK_N // 2  # (fp32: shared memory)
    if page_size >= 16:  # a block within a page
        block_n = min(block_n, page_size)
        assert page_size % block_n == 0, "the page size must be a multiple of the key block"
    grid = (triton.cdiv(num_tokens, BLOCK_Q), num_kv_heads)
    _piece_kernel[grid](
        q, k, v, table, start, rows, out, lse, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        GROUP=group, GROUP_PAD=group_pad, DIM=dim, PAGE_SIZE=page_size, BLOCK_Q=BLOCK_Q,
        BLOCK_N=block_n, WHILE_LOOP=triton.knobs.runtime.interpret,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 stays exact
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out, lse


__all__ = ["paged_piece_attention"]
