"""The attention-sink kernel (:mod:`lightning_ulysses.parallel.sinks`) against transformers' GPT-OSS eager attention:
outputs and gradients (query, key, value and the sinks), causal and with a sliding window, GQA, fp64 and fp32.
In-process; the model under SP is in the architecture matrix (``gpt_oss``)."""

from __future__ import annotations

import pytest
import torch

from lightning_ulysses.parallel.sinks import sink_attention


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 5e-6)])
@pytest.mark.parametrize("window", [None, 8])
def test_sink_attention_is_gpt_oss_eager_attention(dtype, tol, window):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 32, 16, dtype=dtype, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 32, 16, dtype=dtype, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, dtype=dtype, generator=g, requires_grad=True)

    class Module:
        num_key_value_groups, training = 2, False

    module = Module()
    module.sinks = sinks
    positions = torch.arange(32)
    allowed = (positions[None, :] <= positions[:, None]) & (positions[:, None] - positions[None, :] < (window or 64))
    mask = torch.zeros(32, 32, dtype=dtype).masked_fill(~allowed, float("-inf"))[None, None]
    theirs, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.25)
    ours = sink_attention(q, k, v, sinks, window, 0.25)
    assert (theirs - ours).abs().max() <= tol
    dout = torch.randn(theirs.shape, dtype=dtype, generator=g)
    for a, b in zip(torch.autograd.grad(theirs, (q, k, v, sinks), dout),
                    torch.autograd.grad(ours, (q, k, v, sinks), dout)):
        assert (a - b).abs().max() <= tol * max(1.0, float(a.abs().max()))
