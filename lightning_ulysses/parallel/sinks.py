"""Attention with per-head sink logits (GPT-OSS's ``s_aux``): every query's softmax has one more logit, its head's
sink, whose value is 0. After the Ulysses exchange this rank holds all ``S`` positions of its heads, so it holds
its heads' sinks too and the attention is exact locally.

From a kernel that returns the log-sum-exp ``lse`` of the scores (torch's flash-attention-for-CPU op, CUDA's
memory-efficient op, or matmuls: :func:`lightning_ulysses.parallel.ring.block_kernel`):

* ``total = logaddexp(lse, sink)``, the normaliser with the sink;
* ``out = out_kernel · exp(lse - total)``, the output with the sink's share of the softmax removed;
* backward: the kernel's backward from the final ``out`` and ``total`` (the sink has no value, so it enters only
  through the normaliser), and ``d sink = -Σ exp(sink - total) · (dout · out)`` over the batch and positions.

Memory: the kernel's, plus an ``[S, S]`` boolean mask for layers with a sliding window shorter than the sequence.
"""

from __future__ import annotations

from typing import Optional

import torch

from lightning_ulysses.parallel.ring import _block_backward, _block_forward, block_kernel, causal_window_mask


class _SinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,  # type: ignore[override]
                window: Optional[int], scale: float) -> torch.Tensor:
        # q, k [B, h, S, D]; v [B, h, S, Dv] (KV heads already expanded to the query heads); sinks [h]
        S = q.shape[2]
        kernel = block_kernel(q, v)
        mask = None
        if window is not None and window < S:
            positions = torch.arange(S, device=q.device)
            mask = causal_window_mask(positions, positions, window)  # [S, S], True = attend
        out, lse = _block_forward(q, k, v, mask is None, mask, scale, kernel)  # [B, h, S, D], [B, h, S]
        sink = sinks.detach().to(lse.dtype).view(1, -1, 1)
        total = torch.logaddexp(lse, sink)  # [B, h, S]: the normaliser with the sink (the kernel's lse dtype)
        final = (out.to(lse.dtype) * torch.exp(lse - total)[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, final, total, sinks)
        ctx.window, ctx.scale, ctx.kernel, ctx.mask = window, scale, kernel, mask
        return final

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, final, total, sinks = ctx.saved_tensors
        dq, dk, dv = _block_backward(dout.contiguous(), q, k, v, final, total, ctx.mask is None, ctx.mask, ctx.scale,
                                     ctx.kernel)
        delta = (dout.to(total.dtype) * final.to(total.dtype)).sum(-1)  # [B, h, S]
        dsinks = -(torch.exp(sinks.detach().to(total.dtype).view(1, -1, 1) - total) * delta).sum(dim=(0, 2))  # [h]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks.to(sinks.dtype), None, None


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: Optional[int],
                   scale: float) -> torch.Tensor:
    """Causal attention with per-head sinks over this rank's heads: ``q [B, hq, S, D]``, ``k [B, hkv, S, D]``,
    ``v [B, hkv, S, Dv]``, ``sinks [hq]`` -> ``[B, S, hq, Dv]`` (the layout transformers' attention functions
    return). Value heads of another size than the query/key heads run the matmul kernel."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # [B, hkv, S, D] -> [B, hq, S, D]: each KV head for its query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = _SinkAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), sinks, window, scale)
    return out.transpose(1, 2)  # [B, S, hq, D]
