"""``offload_attention``'s exchange per chunk alone, in float64, against full attention (forward and backward), run by
``tests/test_offload_attention.py`` as ``launch(N, "offload_attention:alone", payload)``: every rank holds its
contiguous shard of every head, attends with the exchange per chunk, and compares its output and its shard's
gradients with the same positions of a full-sequence computation (the key/value gradients summed over the ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class Module:
    training = True


def alone(payload: dict) -> dict:
    from lightning_ulysses.parallel.offload_attention import chunked_ulysses_attention
    from lightning_ulysses.parallel.ring import causal_window_mask

    dist.init_process_group("gloo")
    sp, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for case in payload["cases"]:
        B, Hq, Hkv, S, D, window = case["B"], case["Hq"], case["Hkv"], case["S"], case["D"], case.get("window")
        dtype = getattr(torch, case.get("dtype", "float64"))
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, h, S, D, generator=g, dtype=dtype) for h in (Hq, Hkv, Hkv))
        grad = torch.randn(B, S, Hq, D, generator=g, dtype=dtype)
        pos = torch.arange(S)
        allowed = causal_window_mask(pos, pos, window)
        documents = None
        if case.get("document_starts"):
            start = torch.zeros(S, dtype=torch.long)
            start[case["document_starts"]] = 1
            documents = start.cumsum(0).expand(B, S).contiguous()
            allowed = allowed & (documents[:, :, None] == documents[:, None, :])[:, None]
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        full = F.scaled_dot_product_attention(qf, kf.repeat_interleave(Hq // Hkv, 1),
                                              vf.repeat_interleave(Hq // Hkv, 1), attn_mask=allowed).transpose(1, 2)
        (full * grad).sum().backward()
        s = S // sp
        mine = slice(rank * s, (rank + 1) * s)
        ql, kl, vl = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        out = chunked_ulysses_attention(Module(), ql, kl, vl, dist.group.WORLD, case["chunk"], window,
                                        {"scaling": D ** -0.5}, documents)  # [B, s, Hq, D]
        (out * grad[:, mine]).sum().backward()
        dk, dv = kl.grad.clone(), vl.grad.clone()
        errors = {"out": (out - full[:, mine]).abs().max().item(),
                  "dq": (ql.grad - qf.grad[:, :, mine]).abs().max().item(),
                  "dk": (dk - kf.grad[:, :, mine]).abs().max().item(),
                  "dv": (dv - vf.grad[:, :, mine]).abs().max().item()}
        results[case["name"]] = errors
    dist.destroy_process_group()
    return results
