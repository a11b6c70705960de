"""Two partial attention states merged by log-sum-exp in one Triton kernel.

A decode step of a request whose heads stream or are attended on the CPU merges several
partial states a layer (the CPU's part into the GPU's, each staged piece of the history into
the running result, the new token's own key); a prompt piece merges each staged piece of its
prefix. In torch one merge of two ``[heads, tokens, dim]`` states is about fifteen kernels
(casts, a stack, the log-sum-exp, the weights, a product and a sum per part, a cast back)
and as many passes over the values; at decode sizes each of them costs its launch and
nothing else, and in the trace of a 128K request decoding beside short streams (H100) the
torch merge took 23% of the offload lane's thread. This kernel reads each part once and
writes the result once, in one launch. Runs under ``TRITON_INTERPRET=1`` on CPU tensors,
which is how CI compares it with the torch merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 4  # (head, token) rows a program merges: 32 registers a thread on sm_90, a full SM


# every integer argument a run-time value: one compile for each dtype and head dim serves
# every caller's strides and sizes (a compile while a long request decodes stalls it; the
# values are read coalesced across a block's threads, aligned or not)
RUN_TIME = ["num_rows", "tokens", "stride_ah", "stride_at", "stride_lah", "stride_lat",
            "stride_bh", "stride_bt", "stride_lbh", "stride_lbt", "stride_oh", "stride_ot",
            "stride_loh", "stride_lot"]  # fmt: skip


# the log-sum-exps are read a row at a time: their alignment is nothing to the kernel, and
# the hybrid tier's are slices at any head
LSE_POINTERS = ["A_LSE", "B_LSE", "LSE"]


@triton.jit(do_not_specialize=RUN_TIME, do_not_specialize_on_alignment=LSE_POINTERS)
def _merge_pair_kernel(
    A_OUT, A_LSE, B_OUT, B_LSE, OUT, LSE, num_rows, tokens,
    stride_ah, stride_at, stride_lah, stride_lat, stride_bh, stride_bt, stride_lbh, stride_lbt,
    stride_oh, stride_ot, stride_loh, stride_lot,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """``BLOCK_R`` (head, token) rows of ``A`` and ``B`` merged into ``OUT`` / ``LSE``:
    each row's values read once, as fp32. A part with ``-inf`` weighs nothing (whatever its
    values hold); a row empty in both gives 0 and ``-inf``; a NaN log-sum-exp gives NaN in
    both (the engine's check of the logits then ends that request)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < num_rows
    head = (rows // tokens).to(tl.int64)  # int64: a prompt piece's rows pass 2^31 elements
    token = (rows % tokens).to(tl.int64)
    lse_a = tl.load(A_LSE + head * stride_lah + token * stride_lat, mask=valid,
                    other=float("-inf")).to(tl.float32)  # fmt: skip
    lse_b = tl.load(B_LSE + head * stride_lbh + token * stride_lbt, mask=valid,
                    other=float("-inf")).to(tl.float32)  # fmt: skip
    top = tl.maximum(lse_a, lse_b)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight_a, weight_b = tl.exp(lse_a - top), tl.exp(lse_b - top)  # [BLOCK_R]
    total = weight_a + weight_b  # (NaN where a log-sum-exp is: it stays so)
    empty = total == 0
    scale = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
    offs_d = tl.arange(0, BLOCK_D)
    cells = valid[:, None] & (offs_d[None, :] < DIM)  # [BLOCK_R, BLOCK_D]
    a = tl.load(A_OUT + (head * stride_ah + token * stride_at)[:, None] + offs_d[None, :],
                mask=cells & (weight_a > 0)[:, None], other=0.0).to(tl.float32)  # fmt: skip
    b = tl.load(B_OUT + (head * stride_bh + token * stride_bt)[:, None] + offs_d[None, :],
                mask=cells & (weight_b > 0)[:, None], other=0.0).to(tl.float32)  # fmt: skip
    merged = (a * (weight_a * scale)[:, None]) + (b * (weight_b * scale)[:, None])
    out_ptrs = OUT + (head * stride_oh + token * stride_ot)[:, None] + offs_d[None, :]
    tl.store(out_ptrs, merged.to(OUT.dtype.element_ty), mask=cells)
    lse = tl.where(empty, float("-inf"), top + tl.log(tl.where(empty, 1.0, total)))
    tl.store(LSE + head * stride_loh + token * stride_lot, lse, mask=valid)


def merge_pair(
    a_out: torch.Tensor,  # [heads, tokens, dim]
    a_lse: torch.Tensor,  # [heads, tokens]: natural log; -inf where part a saw no key
    b_out: torch.Tensor,  # [heads, tokens, dim]
    b_lse: torch.Tensor,  # [heads, tokens]
    out: torch.Tensor | None = None,  # [heads, tokens, dim]: where the result goes
    lse: torch.Tensor | None = None,  # [heads, tokens] fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from each one's ``(out, lse)``: one
    launch. ``out`` (default: new, of ``a_out``'s dtype) may be ``a_out`` or ``b_out``
    itself (each row is read before it is written), but must overlap neither otherwise;
    likewise ``lse`` (default: new, fp32). Values may be views of any strides but the last
    (1); the parts' dtypes may differ (each is read as fp32)."""
    heads, tokens, dim = a_out.shape
    assert b_out.shape == a_out.shape and a_lse.shape == b_lse.shape == (heads, tokens)
    a_out, b_out = (t if t.stride(-1) == 1 else t.contiguous() for t in (a_out, b_out))
    if out is None:
        out = torch.empty(a_out.shape, dtype=a_out.dtype, device=a_out.device)
    if lse is None:
        lse = torch.empty((heads, tokens), dtype=torch.float32, device=a_out.device)
    assert out.shape == a_out.shape and out.stride(-1) == 1 and lse.shape == (heads, tokens)
    num_rows = heads * tokens
    if num_rows == 0:
        return out, lse
    grid = (triton.cdiv(num_rows, BLOCK_ROWS),)
    _merge_pair_kernel[grid](
        a_out, a_lse, b_out, b_lse, out, lse, num_rows, tokens,
        a_out.stride(0), a_out.stride(1), a_lse.stride(0), a_lse.stride(1),
        b_out.stride(0), b_out.stride(1), b_lse.stride(0), b_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_R=BLOCK_ROWS,
    )  # fmt: skip
    return out, lse


__all__ = ["BLOCK_ROWS", "LSE_POINTERS", "RUN_TIME", "merge_pair"]
