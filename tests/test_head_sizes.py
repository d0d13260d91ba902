"""Value heads of another size than the query/key heads (MLA-style attention, recent MoE families' configs) through
the attention kernels the strategy runs itself: exact against plain softmax attention, or refused before compute.
In-process."""

from __future__ import annotations

import torch

from lightning_ulysses.parallel.sinks import sink_attention


def _reference(q, k, v, sinks, scale):
    """Softmax attention with one extra logit per head (its sink, no value), causal: ``[B, S, h, Dv]``."""
    S = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, h, S, S]
    scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, S, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :S]
    return (probs @ v).transpose(1, 2)


def test_sink_attention_takes_value_heads_of_another_size():
    torch.manual_seed(0)
    B, h, S, D, Dv = 2, 4, 24, 16, 8
    q, k = torch.randn(B, h, S, D, dtype=torch.float64), torch.randn(B, h, S, D, dtype=torch.float64)
    v = torch.randn(B, h, S, Dv, dtype=torch.float64)
    sinks = torch.randn(h, dtype=torch.float64)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    expected = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = sink_attention(*inputs, None, D ** -0.5)
    ref = _reference(*expected, D ** -0.5)
    assert out.shape == (B, S, h, Dv)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    for ours, theirs in zip(inputs, expected):
        torch.testing.assert_close(ours.grad, theirs.grad)
