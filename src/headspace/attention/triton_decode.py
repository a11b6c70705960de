"""Split-K decode attention in Triton: one query token against a long KV, at HBM speed.

Each program takes one kv head and one slice of the keys, attends all query heads of that
kv head's group at once (so each K/V byte is read once), and writes a partial ``(out, lse)``;
a second kernel merges the slices by log-sum-exp. The valid length is read from a device
tensor, so a captured CUDA graph serves every step. Runs under ``TRITON_INTERPRET=1`` on
CPU tensors, which is how CI compares it with the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# slices the merge kernel weighs at a time: a row of one kv head's few query heads over a
# 64K slot has 512 slices; weighed at once they took 59.8 us on an H100 (partial kernel
# included), in blocks of 128 14.6 us (rows of up to 256 slices unchanged;
# bench/profiles/decode_attention.py --groups)
MERGE_SPLIT_BLOCK = 128
MERGE_SMALL_BLOCK = 32  # rows of at most this many slices: one block of this size


def merge_block(num_splits: int) -> int:
    """Slices the merge kernel weighs at a time for rows of ``num_splits``: two sizes, so
    that two compiles serve every count."""
    return MERGE_SMALL_BLOCK if num_splits <= MERGE_SMALL_BLOCK else MERGE_SPLIT_BLOCK


@triton.jit
def _running_max(m_i, candidate):
    """The online softmax's new running maximum ``[heads]`` (log2 units) against a block's
    ``candidate``, the one its exponents subtract (0 while every key so far is masked), and
    the factor ``alpha`` that rescales what was summed under the old one."""
    m_new = tl.maximum(m_i, candidate)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, m_safe, tl.exp2(m_i - m_safe)


@triton.jit
def _share_cut(fraction, length, PAGE_SIZE: tl.constexpr):
    """The key where a copy's cumulative ``fraction`` of a ``length``-key row ends: whole
    pages, rounded half up, the row's end from 1.0 on (``parallel.placement.copy_keys``)."""
    pages = tl.floor(fraction * length.to(tl.float64) / PAGE_SIZE + 0.5).to(tl.int32)
    return tl.where(fraction >= 1.0, length, tl.minimum(length, pages * PAGE_SIZE))


@triton.jit
def _attend_keys(q, k_base, v_base, slots, n_ok, visible, m_i, l_i, acc, stride_kt, stride_vt,
                 scale_log2, DIM: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """The keys of ``slots`` (those ``n_ok``) added to each query row's running softmax,
    where ``visible`` (a row's mask, or the keys' for every row): ``(m_i, l_i, acc)``
    updated, base 2. Shared by the decode and the prompt piece's kernels."""
    offs_d = tl.arange(0, DIM)
    k = tl.load(k_base + slots[:, None] * stride_kt + offs_d[None, :], mask=n_ok[:, None],
                other=0.0)  # fmt: skip
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new, m_safe, alpha = _running_max(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + slots[:, None] * stride_vt + offs_d[None, :], mask=n_ok[:, None],
                other=0.0)  # fmt: skip
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def _attend_block(q, k_base, v_base, table, block_start, end, new_pos, m_i, l_i, acc,
                  stride_kt, stride_vt, scale_log2, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """One block of ``BLOCK_N`` keys from ``block_start`` (those before ``end``, but the
    slot ``new_pos``) added to a running softmax: ``(m_i, l_i, acc)`` updated, base 2."""
    offs_n = block_start + tl.arange(0, BLOCK_N)
    n_ok = (offs_n < end) & (offs_n != new_pos)
    # int64: one plane of entry pages (KV budgets) holds more than 2^31 elements
    page = tl.load(table + block_start // PAGE_SIZE).to(tl.int64)
    slots = page * PAGE_SIZE + offs_n % PAGE_SIZE
    return _attend_keys(q, k_base, v_base, slots, n_ok, n_ok[None, :], m_i, l_i, acc, stride_kt,
                        stride_vt, scale_log2, DIM, PRECISION)  # fmt: skip


# The slice length and the strides that follow the slice count are run-time values, not
# specialised: a block table's width sets them, and each new width compiled the kernel in the
# middle of serving (about 2.5 s at a 128K request's first decode steps; bench/NOTES.md).
@triton.jit(do_not_specialize=["tokens_per_split", "stride_tb", "stride_ob", "stride_oh",
                               "stride_lb", "stride_lh"])  # fmt: skip
def _partial_kernel(
    Q, K, V, TABLE, LENGTHS, NEW_K, NEW_V, NEW_INDEX, KEY_SHARES, OUT, LSE, scale_log2,
    stride_qb, stride_qh, stride_kh, stride_kt, stride_vh, stride_vt, stride_tb,
    stride_nb, stride_nh, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    tokens_per_split,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, APPEND: tl.constexpr, WHILE_LOOP: tl.constexpr,
    AT_INDEX: tl.constexpr, PRECISION: tl.constexpr, SHARE_PERIOD: tl.constexpr,
):  # fmt: skip
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    length = tl.load(LENGTHS + seq)
    first, last = 0, length  # the keys [first, last) this (sequence, kv head) attends
    if SHARE_PERIOD > 0:  # a copy of a head shared with other ranks: its range of the keys,
        # cut by its cumulative shares (row r's are KEY_SHARES[r % SHARE_PERIOD])
        row = (seq * tl.num_programs(0) + kv_head) % SHARE_PERIOD
        first = _share_cut(tl.load(KEY_SHARES + 2 * row), length, PAGE_SIZE)
        last = _share_cut(tl.load(KEY_SHARES + 2 * row + 1), length, PAGE_SIZE)
    start = first + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, last)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, DIM)
    heads = kv_head * GROUP + offs_g
    head_ok = offs_g < GROUP
    q_ptrs = Q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_ok[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    table = TABLE + seq * stride_tb
    new_pos = length - 1
    if AT_INDEX:  # a ring row's new token goes over its oldest window token
        new_pos = tl.load(NEW_INDEX + seq)
    if APPEND:  # the new token's K/V: stored for later steps by the slice whose place in the
        # row holds its position (a copy stores it whether or not its range has it); the
        # slice that attends it masks its slot out of the loads and adds the token's term
        # from registers after the loop (a select on every K/V block instead held the
        # kernel to 2.2 of 3.8 TB/s: bench/profiles/entry_splits.py --append)
        new_k = tl.load(NEW_K + seq * stride_nb + kv_head * stride_nh + offs_d)
        new_v = tl.load(NEW_V + seq * stride_nb + kv_head * stride_nh + offs_d)
        owner = (new_pos >= start) & (new_pos < end)
        place = split * tokens_per_split
        stores = (new_pos >= place) & (new_pos < place + tokens_per_split) & (new_pos < length)
        new_page = tl.load(table + new_pos // PAGE_SIZE, mask=stores, other=0).to(tl.int64)
        new_slot = new_page * PAGE_SIZE + new_pos % PAGE_SIZE
        tl.store(k_base + new_slot * stride_kt + offs_d, new_k, mask=(offs_d < DIM) & stores)
        tl.store(v_base + new_slot * stride_vt + offs_d, new_v, mask=(offs_d < DIM) & stores)
    else:
        new_pos = -1  # no slot masked out
    # A slice wholly past its row's end (rows under a KV budget differ in length) skips its
    # blocks, so the long rows' slices have the GPU to themselves (bench/profiles/entry_splits.py:
    # 128K rows keeping 1K-118K tokens, 2.45 -> 1.87 ms per 32 layers on an H100; rows of
    # equal length unchanged). The trip count is a run-time value (the loop is pipelined all
    # the same). A block never straddles two pages: BLOCK_N divides PAGE_SIZE and split starts.
    if WHILE_LOOP:  # (the interpreter ranges over no run-time bounds)
        block_start = start
        while block_start < end:
            m_i, l_i, acc = _attend_block(q, k_base, v_base, table, block_start, end, new_pos,
                                          m_i, l_i, acc, stride_kt, stride_vt, scale_log2,
                                          DIM, PAGE_SIZE, BLOCK_N, PRECISION)  # fmt: skip
            block_start += BLOCK_N
    else:
        for block_start in tl.range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_block(q, k_base, v_base, table, block_start, end, new_pos,
                                          m_i, l_i, acc, stride_kt, stride_vt, scale_log2,
                                          DIM, PAGE_SIZE, BLOCK_N, PRECISION)  # fmt: skip
    if APPEND:  # the new token's term, in the slice that owns it (new_k and new_v are in the
        # cache's dtype, which is q's)
        s_new = tl.sum(q.to(tl.float32) * new_k.to(tl.float32)[None, :], 1)
        s_new = tl.where(owner, s_new * scale_log2, float("-inf"))
        m_new, m_safe, alpha = _running_max(m_i, s_new)
        p_new = tl.exp2(s_new - m_safe)
        l_i = l_i * alpha + p_new
        p_v = p_new.to(q.dtype).to(tl.float32)  # p rounded as the blocks' dot rounds it
        acc = acc * alpha[:, None] + p_v[:, None] * new_v.to(tl.float32)[None, :]
        m_i = m_new
    has_keys = l_i > 0
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) / 1.4426950408889634,
                   float("-inf"))  # fmt: skip
    o_ptrs = OUT + seq * stride_ob + heads[:, None] * stride_oh + split * stride_os
    tl.store(o_ptrs + offs_d[None, :], out, mask=head_ok[:, None])
    tl.store(LSE + seq * stride_lb + heads * stride_lh + split, lse, mask=head_ok)


@triton.jit(do_not_specialize=["num_splits", "stride_lh"])  # (stride_lh is num_splits)
def _merge_kernel(
    PART_OUT, PART_LSE, OUT, LSE, num_splits, stride_ph, stride_ps, stride_lh, stride_ob,
    stride_oh, NUM_HEADS: tl.constexpr, SPLIT_BLOCK: tl.constexpr, DIM: tl.constexpr,
):  # fmt: skip
    """One (sequence, head) row's ``num_splits`` slices merged by LSE, ``SPLIT_BLOCK`` slices
    at a time with a running maximum (a row of a few heads over a long history has hundreds
    of slices, too many ``[slices, dim]`` values to hold at once). The count is a runtime
    value, not specialised on: a longer block table (a batch's next width bucket) needs no
    new compile while users wait (one took 0.3 s of a serving step: bench/NOTES.md). A row
    of one block sums as a single pass over all its slices would."""
    head = tl.program_id(0)  # a (sequence, head) row
    offs_b = tl.arange(0, SPLIT_BLOCK)
    offs_d = tl.arange(0, DIM)
    lse_row = PART_LSE + head * stride_lh
    m_i = tl.max(tl.full([SPLIT_BLOCK], float("-inf"), tl.float32), 0)  # running maximum
    total = tl.sum(tl.zeros([SPLIT_BLOCK], tl.float32), 0)
    acc = tl.zeros([DIM], tl.float32)
    first = 0
    while first < num_splits:  # (a while loop: the interpreter ranges over no tensor bounds)
        split = first + offs_b
        ok = split < num_splits
        lse = tl.load(lse_row + split, mask=ok, other=float("-inf"))
        m_new = tl.maximum(m_i, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)  # (0 at the first block: nothing summed yet)
        weights = tl.exp(lse - m_safe)  # empty splits weigh 0
        part_ptrs = PART_OUT + head * stride_ph + split[:, None] * stride_ps + offs_d[None, :]
        parts = tl.load(part_ptrs, mask=ok[:, None], other=0.0)
        acc = acc * alpha + tl.sum(parts * weights[:, None], 0)
        total = total * alpha + tl.sum(weights, 0)
        m_i = m_new
        first += SPLIT_BLOCK
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    out = acc / tl.where(total > 0, total, 1.0)
    out_row = OUT + (head // NUM_HEADS) * stride_ob + (head % NUM_HEADS) * stride_oh
    tl.store(out_row + offs_d, out.to(OUT.dtype.element_ty))
    tl.store(LSE + head, tl.where(total > 0, m_safe + tl.log(total), float("-inf")))


def num_splits_for(capacity: int, num_rows: int, num_sms: int = 132) -> int:
    """Key slices per (sequence, kv head) row of ``capacity`` keys: about eight programs per
    SM were every row full, slices of >= 128 tokens.

    Eight, not four: rows shorter than the capacity (a batch's, or a KV budget's uneven
    rows, padded to the widest) leave their slices past the end idle. On an H200
    (bench/profiles/entry_splits.py, 32 layers): 32 rows keeping 0.05-0.58 of 128K, 6.34 -> 4.45 ms
    (2.71 -> 3.86 TB/s); 32 full rows of 32K 4.66 -> 4.27; 8 rows 1.43-1.71 -> 1.33-1.46;
    on an H100 8 rows 1.80-1.86 -> 1.76-1.81 ms. Earlier, at 8K (length-bound either way):
    64 slices per head of one 128-key block each, 4 warps, 2 stages, 2.37 TB/s on an H200.
    """
    by_length = max(1, triton.cdiv(capacity, 128))
    by_occupancy = max(1, triton.cdiv(8 * num_sms, num_rows))
    return int(min(by_length, by_occupancy))


def paged_decode_attention(
    q: torch.Tensor,  # [seqs, heads, dim]: one query token per sequence
    k: torch.Tensor,  # [kv_heads, slots, dim]: the page pool (slot = page * page_size + offset)
    v: torch.Tensor,
    block_tables: torch.Tensor,  # [seqs, max_pages] int32: pages in logical order
    lengths: torch.Tensor,  # [seqs] int: valid keys per sequence (device tensor)
    page_size: int,
    *,
    new_kv: torch.Tensor | None = None,  # [2, seqs, kv_heads, dim]: K/V of the query tokens
    new_index: torch.Tensor | None = None,  # [seqs] int32: where new_kv goes (length - 1)
    scale: float | None = None,
    num_splits: int | None = None,
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    out: torch.Tensor | None = None,
    key_shares: torch.Tensor | None = None,  # [period, 2] float64: copies' share bounds
    sliced_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of a batch of sequences over pages: ``out [seqs, heads, dim]``, ``lse``.

    Keys past each sequence's length are ignored, and so are its table's columns from
    ``ceil(length / page_size)`` on (never read: they may hold anything). With ``new_kv``
    the kernel also stores each sequence's new K/V at position ``length - 1``, or
    ``new_index`` (its page must already be in the table; a sequence of length 0 stores
    nothing). ``num_splits`` key slices per (sequence, kv head) (default:
    :func:`num_splits_for`), ``block_n`` keys per inner step; the rest are Triton launch
    settings. ``out`` (e.g. a head range of a larger tensor) receives the result in place.
    With ``key_shares`` each (sequence, kv head) row ``r = seq * kv_heads + kv_head``
    attends only its keys ``[cut(before), cut(through))`` for ``(before, through) =
    key_shares[r % period]`` (a copy's part of a head shared with other ranks, cut at whole
    pages as :func:`~headspace.parallel.placement.copy_keys` cuts; ``(0, 1)``: every key),
    and a row with no key in its range gives out 0 and lse -inf. ``sliced_rows``: the rows
    the key slices are sized for (default: all ``seqs * kv_heads``): a launch of a rank's
    own heads and its copies gives its own heads' rows, so that the copies add programs
    rather than lengthen every slice (a copy's range beside a short own head ran its keys
    in a few long programs: bench/NOTES.md, "Copies at 32K on two H200s").
    """
    num_seqs, num_heads, dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and q.stride(-1) == 1
    block_n = min(block_n, page_size)
    if q.dtype == torch.float32:  # fp32 blocks of 128 keys overflow shared memory
        block_n = min(block_n, 64)
    assert page_size % block_n == 0, "the page size must be a multiple of the key block"
    if key_shares is not None:  # the cuts must be every rank's: float64 (before, through) rows
        assert key_shares.dtype == torch.float64 and key_shares.is_contiguous()
        assert key_shares.shape[1:] == (2,) and key_shares.device == q.device
    capacity = block_tables.shape[1] * page_size
    num_splits = num_splits or num_splits_for(capacity, sliced_rows or num_seqs * num_kv_heads)
    tokens_per_split = triton.cdiv(triton.cdiv(capacity, num_splits), block_n) * block_n
    num_splits = triton.cdiv(capacity, tokens_per_split)
    scale = dim**-0.5 if scale is None else scale
    part_out = torch.empty(
        num_seqs, num_heads, num_splits, dim, device=q.device, dtype=torch.float32
    )
    part_lse = torch.empty(num_seqs, num_heads, num_splits, device=q.device, dtype=torch.float32)
    new_k, new_v = (new_kv[0], new_kv[1]) if new_kv is not None else (q, q)
    _partial_kernel[(num_kv_heads, num_splits, num_seqs)](
        q, k, v, block_tables, lengths, new_k, new_v,
        new_index if new_index is not None else lengths,
        key_shares if key_shares is not None else part_lse, part_out, part_lse, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        block_tables.stride(0), new_k.stride(0), new_k.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), tokens_per_split,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        DIM=dim, PAGE_SIZE=page_size, BLOCK_N=block_n, WHILE_LOOP=triton.knobs.runtime.interpret,
        APPEND=new_kv is not None, AT_INDEX=new_kv is not None and new_index is not None,
        num_warps=num_warps, num_stages=num_stages,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 stays exact
        SHARE_PERIOD=0 if key_shares is None else key_shares.shape[0],
    )  # fmt: skip
    if out is None:
        out = torch.empty(num_seqs, num_heads, dim, device=q.device, dtype=q.dtype)
    assert out.shape == q.shape and out.stride(-1) == 1
    lse = torch.empty(num_seqs, num_heads, device=q.device, dtype=torch.float32)
    rows_out, rows_lse = part_out.view(-1, num_splits, dim), part_lse.view(-1, num_splits)
    _merge_kernel[(num_seqs * num_heads,)](
        rows_out, rows_lse, out, lse, num_splits, rows_out.stride(0), rows_out.stride(1),
        rows_lse.stride(0), out.stride(0), out.stride(1), NUM_HEADS=num_heads,
        SPLIT_BLOCK=merge_block(num_splits), DIM=dim,
    )  # fmt: skip
    return out, lse


_IDENTITY_TABLES: dict[tuple[torch.device, int], torch.Tensor] = {}


def triton_decode_attention(
    q: torch.Tensor,  # [heads, 1, dim]
    k: torch.Tensor,  # [kv_heads, capacity, dim]; keys past `length` are ignored
    v: torch.Tensor,  # [kv_heads, capacity, dim]
    length: torch.Tensor,  # [1] int, number of valid keys (device tensor)
    *,
    new_kv: torch.Tensor | None = None,  # [2, 1, kv_heads, dim]: K/V of the query token
    block_n: int = 128,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one token over a contiguous buffer: ``out [heads, 1, dim]``, ``lse``.

    The contiguous buffer is a pool whose pages are in order (an identity block table).
    """
    num_pages = triton.cdiv(k.shape[1], block_n)
    key = (q.device, num_pages)
    if key not in _IDENTITY_TABLES:
        _IDENTITY_TABLES[key] = torch.arange(num_pages, device=q.device, dtype=torch.int32)[None]
    out, lse = paged_decode_attention(
        q.transpose(0, 1), k, v, _IDENTITY_TABLES[key], length, block_n,
        new_kv=new_kv, block_n=block_n, **kwargs,
    )  # fmt: skip
    return out.transpose(0, 1), lse.transpose(0, 1)
