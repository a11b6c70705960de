"""Attention backends and the LSE merge against the eager fp32 reference."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headspace.attention import attend, decode_attend, merge_attention, reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter


def _qkv(heads, kv_heads, num_q, num_kv, dim=32, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, num_q, dim, generator=generator).to(dtype)
    k = torch.randn(kv_heads, num_kv, dim, generator=generator).to(dtype)
    v = torch.randn(kv_heads, num_kv, dim, generator=generator).to(dtype)
    return q, k, v


def _naive(q, k, v, causal):
    """Per-head loop softmax in float64: an independent check of the reference itself."""
    group = q.shape[0] // k.shape[0]
    outs, lses = [], []
    for h in range(q.shape[0]):
        scores = q[h].double() @ k[h // group].double().T / q.shape[-1] ** 0.5
        if causal:
            offset = k.shape[1] - q.shape[1]
            mask = torch.ones_like(scores, dtype=torch.bool).tril(offset)
            scores = scores.masked_fill(~mask, float("-inf"))
        lses.append(torch.logsumexp(scores, -1))
        outs.append(torch.softmax(scores, -1) @ v[h // group].double())
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (9, 3), (4, 4), (6, 1)])
@pytest.mark.parametrize("num_q,num_kv", [(1, 1), (37, 37), (13, 101), (1, 77)])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_naive(heads, kv_heads, num_q, num_kv, causal):
    q, k, v = _qkv(heads, kv_heads, num_q, num_kv)
    out, lse = reference_attention(q, k, v, causal=causal)
    ref_out, ref_lse = _naive(q, k, v, causal)
    assert torch.allclose(out.double(), ref_out, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (9, 3), (4, 4), (6, 1)])
@pytest.mark.parametrize("num_q,num_kv", [(1, 1), (37, 37), (13, 101), (1, 77), (129, 257)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_backend_matches_reference(heads, kv_heads, num_q, num_kv, causal):
    q, k, v = _qkv(heads, kv_heads, num_q, num_kv, seed=num_q + num_kv)
    out, lse = attend(q, k, v, causal=causal, backend="sdpa")
    ref_out, ref_lse = reference_attention(q, k, v, causal=causal)
    assert (out - ref_out).abs().max().item() < 1e-5
    assert (lse - ref_lse).abs().max().item() < 1e-5


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("num_q,num_kv", [(37, 37), (13, 101), (48, 48), (40, 90), (5, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_pads_cudnn_calls_to_whole_row_units(heads, kv_heads, num_q, num_kv, causal):
    """cuDNN's calls run whole multiples of CUDNN_ROWS query rows past one unit, a power of
    two below (shapes that repeat over prompt lengths: zero rows past the end, and a causal
    square's keys too); here a unit of 16 rows, the calls recorded on their way to the CPU
    kernel: the reference's out and lse for the real rows, the output in the queries'
    token-major layout, and K/V with their own heads (the kernel maps a query head to its kv
    head; no copy per query head)."""
    from functools import partial

    from headspace.attention import sdpa

    calls = []

    def recording(q4, k4, v4, causal, scale, cudnn):
        per_head_rows = q4.shape[2] * q4.shape[1] // heads  # a folded group's rows unfolded
        calls.append((causal, per_head_rows, k4.shape[2]))
        assert k4.shape[1] == v4.shape[1] == kv_heads
        return sdpa.fused_kernel(q4, k4, v4, causal, scale, cudnn)

    backend = partial(sdpa.sdpa_attention, rows_unit=16, kernel=recording)
    q, k, v = _qkv(heads, kv_heads, num_q, num_kv, seed=num_q + num_kv)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # token-major, as the model's
    out, lse = attend(q, k, v, causal=causal, backend=backend)
    ref_out, ref_lse = reference_attention(q, k, v, causal=causal)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert (out - ref_out).abs().max().item() < 1e-5
    assert (lse - ref_lse).abs().max().item() < 1e-5
    rows = {5: 8, 13: 16, 37: 48, 40: 48, 48: 48}[num_q]
    prefix = num_kv - num_q if causal else num_kv  # keys every row of the chunk sees
    assert calls and len(calls) == (2 if causal and num_q < num_kv else 1)
    for square, call_rows, keys in calls:
        assert call_rows == rows
        assert keys == (rows if square else prefix)
    if (causal and num_q == num_kv) or (not causal and kv_heads == heads):  # one call, not
        assert out.transpose(0, 1).is_contiguous()  # folded: the queries' layout kept


def test_cudnn_rows_repeat_across_lengths():
    """Whole 256-row units past one unit, powers of two below: never fewer rows than asked,
    at most one unit (or twice the rows) more."""
    from headspace.attention.sdpa import cudnn_rows

    assert [cudnn_rows(n) for n in (0, 1, 3, 100, 128, 256, 257, 20100)] == [
        0, 1, 4, 128, 128, 256, 512, 20224,
    ]  # fmt: skip
    for n in range(1, 3000):
        rows = cudnn_rows(n)
        assert n <= rows < max(n + 256, 2 * n)
        assert rows % 256 == 0 or rows <= 256 and rows & (rows - 1) == 0


def test_sdpa_accepts_strided_head_major_views():
    q_tokens = torch.randn(50, 8, 32)  # [tokens, heads, dim] as the model produces it
    k_tokens, v_tokens = torch.randn(2, 50, 2, 32).unbind(0)
    q, k, v = q_tokens.transpose(0, 1), k_tokens.transpose(0, 1), v_tokens.transpose(0, 1)
    out, lse = attend(q, k, v, causal=True)
    ref_out, ref_lse = reference_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), causal=True
    )
    assert (out - ref_out).abs().max().item() < 1e-5


@settings(max_examples=60, deadline=None)
@given(
    num_kv=st.integers(1, 90),
    cuts=st.lists(st.integers(0, 90), max_size=4),
    seed=st.integers(0, 1000),
)
def test_merge_of_random_splits_equals_union(num_kv, cuts, seed):
    q, k, v = _qkv(4, 2, 5, num_kv, seed=seed)
    bounds = [0, *sorted(min(c, num_kv) for c in cuts), num_kv]  # repeats = empty parts
    parts = [reference_attention(q, k[:, a:b], v[:, a:b]) for a, b in itertools.pairwise(bounds)]
    out, lse = merge_attention([p[0] for p in parts], [p[1] for p in parts])
    ref_out, ref_lse = reference_attention(q, k, v)
    assert (out - ref_out).abs().max().item() < 1e-5
    assert (lse - ref_lse).abs().max().item() < 1e-5


@settings(max_examples=40, deadline=None)
@given(num_kv=st.integers(1, 90), span=st.one_of(st.none(), st.integers(1, 100)),
       seed=st.integers(0, 1000))  # fmt: skip
def test_attention_over_key_spans_equals_one_call(num_kv, span, seed):
    """A prompt piece's attention in runs of at most ``span`` keys, merged by LSE, is
    attention over all of them (the runs' count grows as the span shrinks)."""
    from headspace.attention import attend_spans

    q, k, v = _qkv(4, 2, 5, num_kv, seed=seed)
    out, lse = attend_spans(q, k, v, span, backend="reference")
    ref_out, ref_lse = reference_attention(q, k, v)
    assert (out - ref_out).abs().max().item() < 1e-5
    assert (lse - ref_lse).abs().max().item() < 1e-5


def test_merge_with_empty_parts_keeps_zero_rows():
    q, k, v = _qkv(2, 2, 3, 0)
    empty = reference_attention(q, k, v)
    assert torch.isneginf(empty[1]).all() and (empty[0] == 0).all()
    out, lse = merge_attention([empty[0], empty[0]], [empty[1], empty[1]])
    assert torch.isneginf(lse).all() and (out == 0).all()


@settings(max_examples=25, deadline=None)
@given(heads=st.integers(1, 9), tokens=st.integers(1, 40), dim=st.sampled_from([16, 24, 64]),
       cut=st.integers(0, 30), empty=st.sampled_from(["none", "a", "b", "both"]),
       layout=st.sampled_from(["contiguous", "transposed"]), seed=st.integers(0, 1000))  # fmt: skip
def test_merge_kernel_equals_the_union_and_the_torch_merge(heads, tokens, dim, cut, empty,
                                                           layout, seed):  # fmt: skip
    """The GPU's merge of two states (Triton's interpreter on CPU tensors): attention over
    the union of the two key sets, as the torch merge gives it; over views of other strides
    (a decode step's ``[seqs, heads, dim]`` transposed) and parts of other dtypes; a part
    with no key (its values garbage) weighs nothing; a row with none in either gives 0 and
    -inf."""
    from headspace.attention.merge import _merged
    from headspace.attention.merge_kernel import merge_pair

    q, k, v = (t.to(DEVICE) for t in _qkv(heads, heads, tokens, 30, dim, seed=seed))
    cuts = {"none": (cut, 30), "a": (0, 30), "b": (30, 30), "both": (0, 0)}[empty]
    a = reference_attention(q, k[:, : cuts[0]], v[:, : cuts[0]])
    b = reference_attention(q, k[:, cuts[0] : cuts[1]], v[:, cuts[0] : cuts[1]])
    if empty in ("a", "both"):
        a[0].fill_(float("nan"))  # an empty part's values are never read
    if layout == "transposed":  # views [heads, tokens, dim] of [tokens, heads, dim] storage
        a = (a[0].transpose(0, 1).contiguous().transpose(0, 1), a[1].t().contiguous().t())
    b = (b[0].half(), b[1])
    out, lse = merge_pair(a[0], a[1], b[0], b[1])
    assert out.dtype == a[0].dtype and lse.dtype == torch.float32
    want_out, want_lse = reference_attention(q, k[:, : cuts[1]], v[:, : cuts[1]])
    if empty != "both":
        assert (out - want_out).abs().max().item() < 2e-3  # (b's values in fp16)
        torch_out, torch_lse = _merged([a[0].nan_to_num(0.0), b[0]], [a[1], b[1]])
        assert (out - torch_out).abs().max().item() < 1e-5
        assert torch.allclose(lse, torch_lse, atol=1e-5, rtol=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert torch.allclose(lse[~torch.isneginf(lse)], want_lse[~torch.isneginf(want_lse)],
                          atol=1e-5)  # fmt: skip
    assert not out.isnan().any() and (empty != "both" or (out == 0).all())


def test_merge_kernel_writes_into_its_first_part_and_a_slice_of_a_wider_state():
    """A layer merges the CPU's part into the GPU's result in place (``out`` is the first
    part), and a prompt piece merges one kv head's query heads into rows of a wider running
    state (``out`` a slice of it): the rows outside are left as they were."""
    from headspace.attention.merge_kernel import merge_pair

    q, k, v = (t.to(DEVICE) for t in _qkv(6, 6, 3, 20, 32, seed=4))
    a = reference_attention(q, k[:, :7], v[:, :7])
    b = reference_attention(q, k[:, 7:], v[:, 7:])
    want = reference_attention(q, k, v)
    first_out, first_lse = a[0].clone(), a[1].clone()
    out, lse = merge_pair(first_out, first_lse, b[0], b[1], out=first_out, lse=first_lse)
    assert out is first_out and lse is first_lse
    assert (out - want[0]).abs().max().item() < 1e-5
    assert (lse - want[1]).abs().max().item() < 1e-5
    rows = slice(2, 4)
    for merge in (merge_pair, merge_attention):  # the kernel, and the CPU's torch merge
        wide_out, wide_lse = a[0].clone(), a[1].clone()
        if merge is merge_pair:
            merge_pair(wide_out[rows], wide_lse[rows], b[0][rows], b[1][rows],
                       out=wide_out[rows], lse=wide_lse[rows])  # fmt: skip
        else:
            merge_attention([wide_out[rows], b[0][rows]], [wide_lse[rows], b[1][rows]],
                            out=wide_out[rows], lse_out=wide_lse[rows])  # fmt: skip
        assert (wide_out[rows] - want[0][rows]).abs().max().item() < 1e-5
        assert (wide_lse[rows] - want[1][rows]).abs().max().item() < 1e-5
        assert torch.equal(wide_out[:2], a[0][:2]) and torch.equal(wide_out[4:], a[0][4:])
        assert torch.equal(wide_lse[:2], a[1][:2]) and torch.equal(wide_lse[4:], a[1][4:])


def test_the_kernels_fold_of_many_bf16_parts_rounds_once():
    """A decode step's staged pieces of a long history (here 9 parts, bf16) merged two at a
    time by the kernel: the states between pairs stay fp32, so the result is the union's
    attention rounded to bf16 once, as torch's sum gives it, whatever the number of parts
    (rounded at every pair, the error grew with the parts: 3x torch's at 17)."""
    from headspace.attention.merge import _merged, merged_by_kernel

    q, k, v = (t.to(DEVICE) for t in _qkv(8, 8, 4, 90, 64, seed=3))
    cuts = list(range(0, 91, 10))
    parts = [reference_attention(q, k[:, a:b], v[:, a:b]) for a, b in itertools.pairwise(cuts)]
    outs, lses = [p[0].bfloat16() for p in parts], [p[1] for p in parts]
    out, lse = merged_by_kernel(outs, lses)
    want, want_lse = reference_attention(q, k, v)
    torch_out, _ = _merged(outs, lses)
    assert out.dtype == torch.bfloat16 and (lse - want_lse).abs().max().item() < 1e-5
    kernel_error = (out.float() - want).abs().max().item()
    torch_error = (torch_out.float() - want).abs().max().item()
    ulp = want.abs().max().item() * 2**-7  # one bf16 step at the largest value
    assert kernel_error <= torch_error + ulp  # (the interpreter truncates its last rounding)


def test_the_merge_kernel_keeps_a_nan_where_torch_would():
    """A NaN log-sum-exp (a layer that went non-finite) stays NaN in the merged row, values
    and normaliser, so that the engine's check of the logits ends that request; the other
    rows merge as usual."""
    from headspace.attention.merge_kernel import merge_pair

    q, k, v = (t.to(DEVICE) for t in _qkv(2, 2, 3, 20, 16, seed=8))
    a = reference_attention(q, k[:, :9], v[:, :9])
    b = reference_attention(q, k[:, 9:], v[:, 9:])
    a[1][1, 2] = float("nan")
    out, lse = merge_pair(a[0], a[1], b[0], b[1])
    assert torch.isnan(lse[1, 2]) and torch.isnan(out[1, 2]).all()
    want = reference_attention(q, k, v)
    rows = torch.ones(2, 3, dtype=torch.bool, device=DEVICE)
    rows[1, 2] = False
    assert (out[rows] - want[0][rows]).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,capacity,length",
    [(8, 2, 300, 257), (9, 3, 700, 700), (4, 4, 64, 1), (6, 1, 1000, 513)],
)
def test_triton_decode_kernel_matches_reference(dtype, heads, kv_heads, capacity, length):
    """The GPU decode kernel itself, run by Triton's interpreter on CPU tensors."""
    from headspace.attention.triton_decode import triton_decode_attention

    q, k, v = (t.to(DEVICE) for t in _qkv(heads, kv_heads, 1, capacity, 64, dtype, length))
    length_t = torch.tensor([length], device=DEVICE)
    out, lse = triton_decode_attention(q, k, v, length_t, num_splits=3, block_n=64)
    ref_out, ref_lse = reference_attention(q, k[:, :length], v[:, :length])
    tolerance = 1e-5 if dtype == torch.float32 and DEVICE == "cpu" else 2e-3
    assert (out.float() - ref_out.float()).abs().max().item() < tolerance
    assert (lse - ref_lse).abs().max().item() < tolerance


def test_triton_decode_merges_more_slices_than_one_block(monkeypatch):
    """A row of few heads over a long history has more slices than the merge kernel weighs
    at once (47 here, in blocks of 16 so that the interpreter stays quick: two whole blocks
    and a partial one, the last slices past the length empty)."""
    from headspace.attention import triton_decode

    monkeypatch.setattr(triton_decode, "MERGE_SPLIT_BLOCK", 16)
    capacity, length, block_n = 4500, 4001, 32
    per_split = math.ceil(math.ceil(capacity / 70) / block_n) * block_n  # as the kernel's
    assert math.ceil(capacity / per_split) > 2 * triton_decode.MERGE_SPLIT_BLOCK
    q, k, v = (t.to(DEVICE) for t in _qkv(4, 1, 1, capacity, 64, seed=5))
    length_t = torch.tensor([length], device=DEVICE)
    out, lse = triton_decode.triton_decode_attention(q, k, v, length_t, num_splits=70,
                                                     block_n=block_n)  # fmt: skip
    ref_out, ref_lse = reference_attention(q, k[:, :length], v[:, :length])
    tolerance = 1e-5 if DEVICE == "cpu" else 2e-3
    assert (out - ref_out).abs().max().item() < tolerance
    assert (lse - ref_lse).abs().max().item() < tolerance


def test_triton_decode_appends_the_new_token():
    from headspace.attention.triton_decode import triton_decode_attention

    q, k, v = (t.to(DEVICE) for t in _qkv(8, 2, 1, 200, dim=64, seed=3))
    new_kv = torch.randn(2, 1, 2, 64, device=DEVICE)
    k_kernel, v_kernel = k.clone(), v.clone()
    length = torch.tensor([150], device=DEVICE)
    out, lse = triton_decode_attention(
        q, k_kernel, v_kernel, length, new_kv=new_kv, num_splits=4, block_n=32
    )
    k[:, 149], v[:, 149] = new_kv[0, 0], new_kv[1, 0]
    ref_out, ref_lse = reference_attention(q, k[:, :150], v[:, :150])
    assert torch.equal(k_kernel, k) and torch.equal(v_kernel, v)  # stored, nothing else touched
    assert (out - ref_out).abs().max().item() < (1e-5 if DEVICE == "cpu" else 2e-3)
    assert (lse - ref_lse).abs().max().item() < (1e-5 if DEVICE == "cpu" else 2e-3)


def test_decode_attend_cpu_appends_and_attends():
    q, k, v = _qkv(8, 2, 1, 64, seed=4)
    new_kv = torch.randn(2, 1, 2, 32)
    out, _ = decode_attend(q, k, v, torch.tensor([10]), new_kv=new_kv)
    assert torch.equal(k[:, 9], new_kv[0, 0]) and torch.equal(v[:, 9], new_kv[1, 0])
    ref_out, _ = reference_attention(q, k[:, :10], v[:, :10])
    assert torch.equal(out, ref_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,page,start,rows,bucket",
    [(4, 2, 16, 37, 21, 32), (8, 2, 8, 0, 16, 16), (4, 4, 16, 100, 5, 16), (6, 2, 16, 3, 40, 48)],
)
def test_paged_piece_kernel_matches_reference(dtype, heads, kv_heads, page, start, rows, bucket):
    """A prompt piece's causal attention over its sequence's pages (scattered, the table
    padded with another page), its first position and length device values, run by Triton's
    interpreter on CPU tensors: the piece's rows equal the fp32 reference over the logical
    keys, and the padding rows of the bucket are left as they were."""
    from headspace.attention.triton_piece import paged_piece_attention

    generator = torch.Generator().manual_seed(start + rows)
    needed = -(-(start + rows) // page)
    pool_pages = needed + 4
    order = torch.randperm(pool_pages, generator=generator)[:needed].to(torch.int32)
    table = torch.cat([order, torch.full((3,), pool_pages - 1, dtype=torch.int32)]).to(DEVICE)
    k, v = (torch.randn(kv_heads, pool_pages * page, 16, generator=generator).to(dtype).to(DEVICE)
            for _ in range(2))  # fmt: skip
    q = torch.randn(bucket, heads, 16, generator=generator).to(dtype).to(DEVICE)
    out = torch.full_like(q, 7.0)
    ints = {"device": DEVICE, "dtype": torch.long}
    paged_piece_attention(q, k, v, table, torch.tensor([start], **ints),
                          torch.tensor([rows], **ints), page, out=out)  # fmt: skip
    _, lse = paged_piece_attention(q, k, v, table, torch.tensor([start], **ints),
                                   torch.tensor([rows], **ints), page)  # fmt: skip
    positions = torch.arange(start + rows, device=DEVICE)
    slots = table[positions // page].long() * page + positions % page
    want, want_lse = reference_attention(q[:rows].transpose(0, 1), k[:, slots], v[:, slots],
                                         causal=True)  # fmt: skip
    tolerance = 1e-5 if dtype == torch.float32 and DEVICE == "cpu" else 2e-3
    assert (out[:rows].transpose(0, 1).float() - want.float()).abs().max().item() < tolerance
    assert (lse[:, :rows] - want_lse).abs().max().item() < tolerance
    assert (out[rows:] == 7.0).all()
