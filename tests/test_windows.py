"""Sliding-window attention after the exchange, in one process: the banded SDPA computation equals attention with
transformers' window mask (key > query - window, causal), never looks at more than 2·window - 1 keys per query
block, and composes with packed documents. End to end (SP=2 vs a plain process) the architecture matrix checks
mistral, qwen2, starcoder2, gemma3, cohere2, exaone4, ministral and olmo3 with windows shorter than the sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_ulysses.context import ShardInfo
from lightning_ulysses.models.hf_attention import _attend_documents, _sdpa_causal


class Module:
    num_key_value_groups = 2
    is_causal = True


def reference(q, k, v, window, documents=None):
    """Dense attention with the window (and document) mask: [B, h, L, D] -> [B, L, hq, D]."""
    L = q.shape[2]
    pos = torch.arange(L)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - (window or L + 1))
    if documents is not None:
        allowed &= documents[:, None] == documents[None, :]
    k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2)


def recording_sdpa(key_lengths):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def inner(module, q, k, v, mask, **kwargs):
        key_lengths.append(k.shape[2])
        return sdpa_attention_forward(module, q, k, v, mask, **kwargs)

    return inner


@pytest.mark.parametrize("L, window", [(32, 8), (37, 8), (16, 5), (8, 8), (8, 64), (33, 1)])
def test_banded_sdpa_equals_the_window_mask(L, window):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, L, 8), torch.randn(2, 2, L, 8), torch.randn(2, 2, L, 8)
    lengths: list[int] = []
    out = _sdpa_causal(recording_sdpa(lengths), Module(), q, k, v, window, {})
    torch.testing.assert_close(out, reference(q, k, v, window), rtol=1e-5, atol=1e-6)
    if window < L:
        assert max(lengths) <= 2 * window - 1  # memory grows with L x window, not L^2
        assert len(lengths) == -(-L // window)


def test_windows_inside_packed_documents():
    torch.manual_seed(1)
    S, window = 24, 4
    q, k, v = torch.randn(1, 4, S, 8), torch.randn(1, 2, S, 8), torch.randn(1, 2, S, 8)
    cu_seqlens = torch.tensor([0, 10, 11, 24], dtype=torch.int32)  # documents of 10, 1 and 13 tokens
    documents = torch.tensor([0] * 10 + [1] + [2] * 13)
    shard = ShardInfo(S, cu_seqlens, 13)
    lengths: list[int] = []
    out = _attend_documents("sdpa", recording_sdpa(lengths), Module(), q, k, v, shard, {}, window)
    torch.testing.assert_close(out, reference(q, k, v, window, documents), rtol=1e-5, atol=1e-6)
    assert max(lengths) <= 2 * window - 1
