"""Ring attention alone, in float64, against full causal attention (forward and backward), run by
``tests/test_ring.py`` as ``launch(N, "ring:ring_alone", payload)``: every rank holds its zigzag
tokens, attends over the ring group, and compares with the same positions of a full-sequence computation."""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn.functional as F


class Module:
    num_key_value_groups = 1
    is_causal = True


def ring_alone(payload: dict) -> dict:
    from lightning_ulysses.parallel import ring
    from lightning_ulysses.parallel.geometry import SequenceGeometry
    from lightning_ulysses.parallel.ring import ring_attention

    block_kernel = ring.block_kernel

    dist.init_process_group("gloo")
    R, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for case in payload["cases"]:
        B, Hq, Hkv, S, D, window = case["B"], case["Hq"], case["Hkv"], case["S"], case["D"], case.get("window")
        # the kernel of each block: the fused CPU op (default) or the matmul fallback (other devices)
        ring.block_kernel = block_kernel if case.get("kernel", "fused") == "fused" else (lambda q: "matmul")
        dtype = getattr(torch, case.get("dtype", "float64"))
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, h, S, D, generator=g, dtype=dtype) for h in (Hq, Hkv, Hkv))
        grad_out = torch.randn(B, S, Hq, D, generator=g, dtype=dtype)
        # the reference: full causal (windowed) attention on one rank's worth of everything
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        pos = torch.arange(S)
        allowed = pos[None, :] <= pos[:, None]
        if window:
            allowed &= pos[None, :] > pos[:, None] - window
        documents = None
        if case.get("document_starts"):  # packed documents: attend within the same document only
            start = torch.zeros(S, dtype=torch.long)
            start[case["document_starts"]] = 1
            doc = start.cumsum(0)  # [S]
            allowed &= doc[None, :] == doc[:, None]
            documents = doc.expand(B, S).contiguous()
        full = F.scaled_dot_product_attention(qf, kf.repeat_interleave(Hq // Hkv, 1),
                                              vf.repeat_interleave(Hq // Hkv, 1), attn_mask=allowed)
        full = full.transpose(1, 2)  # [B, S, Hq, D]
        (full * grad_out).sum().backward()
        # this rank: its zigzag tokens
        idx = SequenceGeometry(R, R).shard_index(S, rank)
        ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
        module = Module()
        module.num_key_value_groups = Hq // Hkv
        out = ring_attention(module, ql, kl, vl, dist.group.WORLD, window, {}, documents)  # [B, L, Hq, D]
        (out * grad_out[:, idx]).sum().backward()
        # the keys' gradients: every rank's queries contribute to every key; sum the ranks' local key gradients
        # at their positions is what the gather's adjoint already did, so compare directly
        results[case["name"]] = {
            "out": (out - full[:, idx]).abs().max().item(),
            "dq": (ql.grad - qf.grad[:, :, idx]).abs().max().item(),
            "dk": (kl.grad - kf.grad[:, :, idx]).abs().max().item(),
            "dv": (vl.grad - vf.grad[:, :, idx]).abs().max().item(),
            "scale": full.abs().max().item(),
        }
    ring.block_kernel = block_kernel
    dist.destroy_process_group()
    return results


def layout_groups(payload: dict) -> dict:
    """The device mesh and groups of :class:`SequenceParallelLayout` for each ``(sp_size, ring_size)`` of the
    payload, as global ranks (every rank builds every layout: mesh creation is collective)."""
    from lightning_ulysses.parallel.layout import SequenceParallelLayout

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    out = {}
    for sp_size, ring_size in payload["layouts"]:
        layout = SequenceParallelLayout.build("cpu", sp_size, ring_size)
        out[(sp_size, ring_size)] = {
            "dims": layout.mesh.mesh_dim_names,
            "sp_dims": layout.sp_mesh.mesh_dim_names,
            "sp": dist.get_process_group_ranks(layout.sp_group),
            "ulysses": dist.get_process_group_ranks(layout.ulysses_group),
            "ring": dist.get_process_group_ranks(layout.ring_group),
            "dp": dist.get_process_group_ranks(layout.mesh.get_group("dp")),
            "ranks": (layout.dp_rank, layout.sp_rank, layout.dp_size),
        }
    # Nobody leaves while a peer is still connecting to the new groups (a rank that exits first resets the
    # connections of the others: seen as "Broken pipe" in group creation on a loaded machine).
    dist.barrier()
    return out
