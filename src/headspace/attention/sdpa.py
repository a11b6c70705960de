"""Fast whole-block attention through torch's fused kernels, returning the LSE too.

GPU: cuDNN (fastest prefill on Hopper), else flash (memory-efficient for fp32). CPU: torch's flash
kernel for CPU. ``causal`` here needs as many queries as keys (a square diagonal block);
``attention.attend`` splits other causal cases into a prefix part and a diagonal part.

cuDNN builds an execution plan for every new shape (45-70 ms on an H100), and a prompt's last
chunk has a new row count at every new prompt length. So cuDNN's calls run whole multiples of
:data:`CUDNN_ROWS` query rows (:func:`cudnn_rows`), shapes that repeat across lengths: the
rows past a call's end are zeros, and a causal block's keys too (after every real row's, so
the mask hides them); their outputs are dropped (``bench/profiles/prompt_lengths.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from headspace.model.compile_meter import COMPILE_METER

aten = torch.ops.aten
CUDNN_ROWS = 256  # cuDNN's calls run whole multiples of this many query rows


def sdpa_attention(
    q: torch.Tensor,  # [heads, q_tokens, dim]
    k: torch.Tensor,  # [kv_heads, kv_tokens, dim]
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    rows_unit: int | None = None,
    kernel: Callable | None = None,
    plans: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention; returns ``out [heads, q_tokens, dim]`` and fp32 ``lse [heads, q]``.
    ``rows_unit``: the call runs whole units of this many query rows (:func:`cudnn_rows`);
    default :data:`CUDNN_ROWS` where cuDNN runs, else the rows given. ``kernel``: in place
    of :func:`fused_kernel` (same arguments), e.g. to record the calls. ``plans``: False
    never runs cuDNN (:func:`unplanned_attention`)."""
    assert not causal or q.shape[1] == k.shape[1], "causal sdpa needs a square block"
    num_heads, num_q, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
    cudnn = plans and _use_cudnn(q)
    if rows_unit is None:
        rows_unit = CUDNN_ROWS if cudnn else 0
    num_rows = cudnn_rows(num_q, rows_unit) if rows_unit else num_q  # zeros past num_q
    group = num_heads // k.shape[0]
    if causal or group == 1:  # the mask depends on the query row: rows stay per head
        q4 = _with_rows(q, num_rows, token_major=True).unsqueeze(0)
        num_keys = num_rows if causal else k.shape[1]  # a square's keys past the end: zeros
        # cuDNN and the CPU's flash kernel map query head h to kv head h // group
        # themselves; the others take K/V repeated for each query head
        repeat = 1 if cudnn or q.device.type == "cpu" else group
        k4, v4 = (_heads(x, repeat, num_keys).unsqueeze(0) for x in (k, v))
    else:  # fold the group's query heads into rows: no copy of a long prefix's K/V
        q4 = _with_rows(q, num_rows, token_major=False)
        q4 = q4.reshape(1, k.shape[0], group * num_rows, dim)
        k4, v4 = k.unsqueeze(0), v.unsqueeze(0)
    out, lse = (kernel or fused_kernel)(q4, k4, v4, causal, scale, cudnn)
    out = out.reshape(num_heads, num_rows, dim)[:, :num_q]
    return out, lse.reshape(num_heads, num_rows)[:, :num_q].float()


def unplanned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool = False, scale: float | None = None):  # fmt: skip
    """:func:`sdpa_attention` without cuDNN (flash on a GPU; the same kernels elsewhere),
    for calls whose shapes seldom recur: a mixed step's piece (a new length over a new
    prefix at nearly every step), where cuDNN would build an execution plan (45-70 ms) at
    each; a burst's steps took 55-90 ms instead of about 15 (H100, bench/NOTES.md)."""
    return sdpa_attention(q, k, v, causal=causal, scale=scale, plans=False)


def cudnn_rows(num_q: int, unit: int | None = None) -> int:
    """Query rows a cuDNN call of ``num_q`` rows runs: whole multiples of ``unit``
    (:data:`CUDNN_ROWS` by default) past one unit, else the next power of two (a small call
    is not doubled by a unit)."""
    unit = CUDNN_ROWS if unit is None else unit
    if num_q > unit:
        return -(-num_q // unit) * unit
    return 1 << (num_q - 1).bit_length() if num_q > 1 else num_q


def causal_plan_rows(chunk: int) -> list[int]:
    """Rows (and keys) of each causal square cuDNN runs for a prompt piece of 3 to ``chunk``
    tokens padded (:func:`cudnn_rows`): the powers of two from 4 to :data:`CUDNN_ROWS`, then
    its multiples, up to ``cudnn_rows(chunk)``."""
    top = cudnn_rows(chunk)
    powers = [1 << bits for bits in range(2, CUDNN_ROWS.bit_length()) if 1 << bits <= top]
    return powers + list(range(2 * CUDNN_ROWS, top + 1, CUDNN_ROWS))


def warm_causal_plans(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device | str, max_rows: int) -> int:  # fmt: skip
    """Build now, where cuDNN runs, the plan of each causal square a prefill of a piece of
    up to ``max_rows`` tokens meets (:func:`causal_plan_rows`), through
    :func:`sdpa_attention` as the prefill's ``attend(q, k, v, causal=True)`` calls it:
    zero ``q [heads, rows - 1, dim]`` and ``k, v [kv_heads, rows - 1, dim]``, head-major
    views of token-major tensors as the model's projections give them; how many plans were
    new (0 without cuDNN). Torch keeps cuDNN's plans per thread: call it on the thread that
    prefills. A piece of exactly its rows (a multiple of :data:`CUDNN_ROWS`, a power of two
    below it) runs unpadded, K/V read in place, token-major: strides of another plan, not
    built here (a full chunk's is built by its first prompt)."""
    built = 0

    def counted(q4, k4, v4, causal: bool, scale: float, cudnn: bool):
        nonlocal built
        built += cudnn and not COMPILE_METER.has_met(_plan_key(q4, k4, v4, causal))
        return fused_kernel(q4, k4, v4, causal, scale, cudnn)

    if not cudnn_runs(dtype, device):
        return 0
    with torch.inference_mode():
        for rows in causal_plan_rows(max_rows):
            q = torch.zeros(rows - 1, num_heads, head_dim, dtype=dtype, device=device)
            kv = torch.zeros(2, rows - 1, num_kv_heads, head_dim, dtype=dtype, device=device)
            k, v = kv.transpose(1, 2)  # [kv_heads, rows - 1, dim] each
            sdpa_attention(q.transpose(0, 1), k, v, causal=True, kernel=counted)
    return built


def _with_rows(x: torch.Tensor, num_rows: int, token_major: bool) -> torch.Tensor:
    """``x [heads, rows, dim]`` followed by zero rows up to ``num_rows`` (``x`` itself when
    none), stored token-major (as the model's projections are: the output keeps that
    layout) or head-major (heads then fold into rows without a copy)."""
    num_heads, num_given, dim = x.shape
    if num_rows == num_given:
        return x
    if token_major:
        padded = x.new_empty(num_rows, num_heads, dim).transpose(0, 1)
    else:
        padded = x.new_empty(num_heads, num_rows, dim)
    padded[:, :num_given] = x
    padded[:, num_given:] = 0
    return padded


def _heads(kv: torch.Tensor, repeat: int, num_rows: int) -> torch.Tensor:
    """``kv [kv_heads, keys, dim]`` with each head repeated ``repeat`` times (once per query
    head of its group, for a kernel that needs as many kv heads as query heads) and followed
    by zero keys up to ``num_rows``, in one copy: ``[kv_heads x repeat, rows, dim]`` (``kv``
    itself when neither is needed)."""
    num_kv, num_given, dim = kv.shape
    if repeat == 1 and num_rows == num_given:
        return kv
    out = kv.new_empty(num_kv, repeat, num_rows, dim)
    out[:, :, :num_given] = kv[:, None]
    out[:, :, num_given:] = 0
    return out.view(num_kv * repeat, num_rows, dim)


def fused_kernel(q4, k4, v4, causal: bool, scale: float,
                 cudnn: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """torch's fused kernel for ``q4 [1, heads, rows, dim]`` over ``k4, v4 [1, kv_heads,
    keys, dim]`` (as many kv heads as query heads for efficient and flash; fewer, each
    serving ``heads // kv_heads`` query heads in order, for cuDNN and the CPU's flash
    kernel): the CPU's flash kernel, else cuDNN (``cudnn``), else efficient (fp32) or flash;
    ``(out, lse [1, heads, rows])``."""
    if q4.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, causal, scale=scale
        )[:2]
    elif cudnn:  # (a new shape: cuDNN builds its plan first, 45-70 ms, metered by name)
        with COMPILE_METER.first_use(_plan_key(q4, k4, v4, causal),
                                     lambda: _plan_name(q4, k4, causal)):  # fmt: skip
            out, lse = aten._scaled_dot_product_cudnn_attention(
                q4, k4, v4, None, True, 0.0, causal, False, scale=scale
            )[:2]
    elif q4.dtype == torch.float32:  # flash kernels are half-precision only
        out, lse = aten._scaled_dot_product_efficient_attention(
            q4, k4, v4, None, True, 0.0, causal, scale=scale
        )[:2]
    else:
        out, lse = aten._scaled_dot_product_flash_attention(
            q4, k4, v4, 0.0, causal, False, scale=scale
        )[:2]
    return out, lse[..., : q4.shape[2]]


def _plan_key(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool) -> tuple:
    """What a cuDNN attention plan is built for: shapes, strides, dtype, mask, device, and
    the thread (torch keeps its cache of plans per thread; a lane runs on either of two)."""
    return ("cudnn", q4.shape, q4.stride(), k4.shape, k4.stride(), v4.shape, v4.stride(),
            q4.dtype, causal, q4.device, threading.get_ident())  # fmt: skip


def _plan_name(q4: torch.Tensor, k4: torch.Tensor, causal: bool) -> str:
    mask = ", causal" if causal else ""
    return (f"cuDNN attention plan: {q4.shape[2]} query rows x {q4.shape[1]} heads over "
            f"{k4.shape[2]} keys{mask}")  # fmt: skip


def cudnn_runs(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether attention over tensors of ``dtype`` on ``device`` runs cuDNN's kernel."""
    return _use_cudnn(torch.empty(0, dtype=dtype, device=device))


def _use_cudnn(q: torch.Tensor) -> bool:
    return (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and torch.backends.cudnn.is_available()
        and torch.cuda.get_device_capability(q.device)[0] >= 9
    )
