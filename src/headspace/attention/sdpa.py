"""Fast whole-block attention through torch's fused kernels, returning the LSE too.

GPU: cuDNN (fastest prefill on Hopper), else flash (memory-efficient for fp32). CPU: torch's flash
kernel for CPU. ``causal`` here needs as many queries as keys (a square diagonal block);
``attention.attend`` splits other causal cases into a prefix part and a diagonal part.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _expand_kv(kv: torch.Tensor, group: int) -> torch.Tensor:
    return kv if group == 1 else kv.repeat_interleave(group, dim=0)


def sdpa_attention(
    q: torch.Tensor,  # [heads, q_tokens, dim]
    k: torch.Tensor,  # [kv_heads, kv_tokens, dim]
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention; returns ``out [heads, q_tokens, dim]`` and fp32 ``lse [heads, q]``."""
    assert not causal or q.shape[1] == k.shape[1], "causal sdpa needs a square block"
    num_heads, num_q, dim = q.shape
    group = num_heads // k.shape[0]
    scale = dim**-0.5 if scale is None else scale
    if causal or group == 1:  # the mask depends on the query row: give each head its keys
        q4 = q.unsqueeze(0)
        k4, v4 = _expand_kv(k, group).unsqueeze(0), _expand_kv(v, group).unsqueeze(0)
    else:  # fold the group's query heads into rows: no copy of a long prefix's K/V
        q4 = q.reshape(1, k.shape[0], group * num_q, dim)
        k4, v4 = k.unsqueeze(0), v.unsqueeze(0)
    out, lse = _fused(q4, k4, v4, causal, scale)
    return out.reshape(num_heads, num_q, dim), lse.reshape(num_heads, num_q).float()


def _fused(q4, k4, v4, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if q4.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, causal, scale=scale
        )[:2]
    elif _use_cudnn(q4):
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


def _use_cudnn(q: torch.Tensor) -> bool:
    return (
        q.dtype in (torch.bfloat16, torch.float16)
        and torch.backends.cudnn.is_available()
        and torch.cuda.get_device_capability(q.device)[0] >= 9
    )
