"""The Ulysses all-to-all exchange: sequence-sharded ⇄ head-sharded tensors, differentiable, over one SP group.

Notation in the shape comments: ``B`` batch, ``S`` full sequence, ``s = S / sp`` this rank's shard, ``Hq``/``Hkv``
query/key-value heads of the model, ``hq = Hq / sp``/``hkv`` heads per rank after the exchange, ``D`` head dim.

One forward pass of one attention layer costs exactly two all-to-alls (q, k and v travel packed in one; the output
in the other), and its backward two more.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """All-to-all along dim 0: chunk ``i`` of the input goes to rank ``i``; chunk ``j`` of the output came from rank
    ``j``. The exchange is its own adjoint, so the backward pass is the same exchange applied to the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def replicate_kv_heads(kv: torch.Tensor, sp_size: int) -> torch.Tensor:
    """Repeat each KV head so that ``sp_size`` ranks each get the KV head their query heads use (GQA/MQA with
    fewer KV heads than ranks). ``[B, Hkv, s, D] -> [B, sp, s, D]``; needs ``sp_size % Hkv == 0``."""
    num_kv_heads = kv.shape[1]
    if num_kv_heads >= sp_size:
        return kv
    return kv.repeat_interleave(sp_size // num_kv_heads, dim=1)


def sequence_to_head_shards(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exchange this rank's sequence shard of all heads for the full sequence of its share of the heads.

    Args:
        query: ``[B, Hq, s, D]``.
        key, value: ``[B, Hkv, s, D]``; ``Hkv`` divisible by sp, or dividing sp (KV heads are then replicated).
        group: the SP group; rank ``j`` of the group holds sequence positions ``[j*s, (j+1)*s)``.

    Returns:
        ``[B, hq, S, D]``, ``[B, hkv, S, D]``, ``[B, hkv, S, D]``: heads ``[j*hq, (j+1)*hq)`` on rank ``j``.
    """
    sp = dist.get_world_size(group)
    key, value = replicate_kv_heads(key, sp), replicate_kv_heads(value, sp)
    B, Hq, s, D = query.shape
    hq, hkv = Hq // sp, key.shape[1] // sp
    if key.shape[-1] == D and value.shape[-1] == D:
        # One exchange for q, k and v: per destination rank, its heads of q, k and v side by side.
        packed = torch.cat(
            [query.view(B, sp, hq, s, D), key.view(B, sp, hkv, s, D), value.view(B, sp, hkv, s, D)], dim=2
        )  # [B, sp(dest), hq+2hkv, s, D]
        received = _AllToAll.apply(packed.transpose(0, 1), group)  # [sp(src = seq chunk), B, hq+2hkv, s, D]
        full = received.permute(1, 2, 0, 3, 4).reshape(B, hq + 2 * hkv, sp * s, D)  # [B, hq+2hkv, S, D]
        q, k, v = full.split([hq, hkv, hkv], dim=1)
        return q, k, v
    return tuple(_heads_from_sequence(t, group) for t in (query, key, value))  # type: ignore[return-value]


def _heads_from_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, H, s, D] -> [B, H/sp, S, D]`` for one tensor (heads of different widths cannot travel packed)."""
    sp = dist.get_world_size(group)
    B, H, s, D = x.shape
    send = x.view(B, sp, H // sp, s, D).transpose(0, 1)  # [sp(dest), B, h, s, D]
    received = _AllToAll.apply(send, group)  # [sp(src = seq chunk), B, h, s, D]
    return received.permute(1, 2, 0, 3, 4).reshape(B, H // sp, sp * s, D)


def head_to_sequence_shards(attn_output: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Return the attention output to sequence sharding.

    Args:
        attn_output: ``[B, S, hq, D]`` (the layout Hugging Face attention functions return).

    Returns:
        ``[B, s, Hq, D]``: this rank's sequence shard with all heads, in head order.
    """
    sp = dist.get_world_size(group)
    B, S, hq, D = attn_output.shape
    send = attn_output.view(B, sp, S // sp, hq, D).transpose(0, 1)  # [sp(dest = seq chunk), B, s, hq, D]
    received = _AllToAll.apply(send, group)  # [sp(src = head chunk), B, s, hq, D]
    return received.permute(1, 2, 0, 3, 4).reshape(B, S // sp, sp * hq, D)
