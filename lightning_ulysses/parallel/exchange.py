"""The Ulysses all-to-all exchange: sequence-sharded ⇄ head-sharded tensors, differentiable, over one SP group.

Notation in the shape comments: ``B`` batch, ``S`` full sequence, ``s = S / sp`` this rank's shard, ``Hq``/``Hkv``
query/key-value heads of the model, ``hq``/``hkv`` heads this rank holds after the exchange, ``D`` head dim.

One forward pass of one attention layer costs exactly two all-to-alls (q, k and v travel packed in one; the output
in the other), and its backward two more; none in a group of one rank (ring attention alone, ``ring_size = sp_size``),
whose rank holds every head of its tokens already.

Head counts: when ``sp`` divides ``Hq`` (and divides or is a multiple of ``Hkv``) every rank gets the same number of
heads, and KV heads travel as they are (replicated when ``Hkv < sp``). Otherwise the heads are split unevenly: rank
``j`` gets ``ceil`` or ``floor`` of ``Hq / sp`` query heads (:func:`head_counts`), and with GQA the KV heads are first
expanded to one per query head so each rank holds the KV heads of its own query heads. The busiest rank then holds
``ceil(Hq / sp)`` heads: attention time and memory follow that rank, e.g. 6 heads at sp 4 cost 2/6 of the work on
the busiest rank instead of the 1.5/6 an even split would.

The sequence mixers (:mod:`lightning_ulysses.models.mixers`, :mod:`lightning_ulysses.models.mixer_heads`) exchange
their projected channels as attention does: one all-to-all of each rank's channels before the mixer's convolution and
scan (:func:`sequence_to_channel_shards`), one of its per-head output after them (:func:`channel_to_sequence_shards`),
and an all-reduce for the few small projections every rank needs whole. A mixer that cannot run that way falls back
to an all-gather of the sequence shards before the mixer and a reduce-scatter of the ranks' partial outputs after it
(each the other's backward). Those are the functions at the end of this module, the only place they are written.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from lightning_ulysses.parallel.layout import group_rank, group_size


class _AllToAll(torch.autograd.Function):
    """All-to-all along dim 0: ``input_splits[i]`` rows go to rank ``i``, ``output_splits[j]`` rows come from rank
    ``j``. Its adjoint is the same exchange with the splits swapped, which is the backward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, input_splits: list[int], output_splits: list[int],  # type: ignore[override]
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.input_splits, ctx.output_splits = group, input_splits, output_splits
        return _all_to_all(x, input_splits, output_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _all_to_all(grad, ctx.output_splits, ctx.input_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, input_splits: list[int], output_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    even = len(set(input_splits)) == 1 and len(set(output_splits)) == 1
    dist.all_to_all_single(out, x, None if even else output_splits, None if even else input_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, input_splits: list[int], output_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all along dim 0 (rows ``input_splits[i]`` to rank ``i``)."""
    return _AllToAll.apply(x, list(input_splits), list(output_splits), group)


def head_counts(num_heads: int, sp_size: int) -> list[int]:
    """Heads each SP rank holds after the exchange: as even as possible, the first ranks take one more."""
    base, extra = divmod(num_heads, sp_size)
    return [base + (1 if j < extra else 0) for j in range(sp_size)]


def is_even_split(num_heads: int, num_kv_heads: int, sp_size: int) -> bool:
    """Whether heads split evenly (KV heads split or replicated) without expanding KV heads."""
    return num_heads % sp_size == 0 and (num_kv_heads % sp_size == 0 or sp_size % num_kv_heads == 0)


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
        key, value: ``[B, Hkv, s, D]`` with ``Hq % Hkv == 0``.
        group: the SP group; rank ``j`` of the group holds sequence positions ``[j*s, (j+1)*s)``.

    Returns:
        ``[B, hq, S, D]``, ``[B, hkv, S, D]``, ``[B, hkv, S, D]``: rank ``j`` holds query heads
        ``[sum(head_counts[:j]), sum(head_counts[:j+1]))``, and the KV heads they use.
    """
    sp = group_size(group)
    if sp == 1:  # a group of one rank (ring attention alone: ring_size = sp_size) holds every head already
        return query, key, value
    B, Hq, s, D = query.shape
    Hkv = key.shape[1]
    if not is_even_split(Hq, Hkv, sp):
        return _sequence_to_uneven_head_shards(query, key, value, group)
    key, value = replicate_kv_heads(key, sp), replicate_kv_heads(value, sp)
    hq, hkv = Hq // sp, key.shape[1] // sp
    if key.shape[-1] != D or value.shape[-1] != D:
        return tuple(_heads_from_sequence(t, group) for t in (query, key, value))  # type: ignore[return-value]
    # One exchange for q, k and v: per destination rank, its heads of q, k and v side by side.
    packed = torch.cat(
        [query.view(B, sp, hq, s, D), key.view(B, sp, hkv, s, D), value.view(B, sp, hkv, s, D)], dim=2
    )  # [B, sp(dest), hq+2hkv, s, D]
    rows = B * (hq + 2 * hkv)
    received = all_to_all(packed.transpose(0, 1).reshape(sp * rows, s, D), [rows] * sp, [rows] * sp, group)
    received = received.view(sp, B, hq + 2 * hkv, s, D)  # [sp(src = seq chunk), B, hq+2hkv, s, D]
    full = received.permute(1, 2, 0, 3, 4).reshape(B, hq + 2 * hkv, sp * s, D)  # [B, hq+2hkv, S, D]
    q, k, v = full.split([hq, hkv, hkv], dim=1)
    return q, k, v


def _heads_from_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, H, s, D] -> [B, H/sp, S, D]`` for one tensor (heads of different widths cannot travel packed)."""
    sp = group_size(group)
    B, H, s, D = x.shape
    send = x.view(B, sp, H // sp, s, D).transpose(0, 1).reshape(sp * B * (H // sp), s, D)  # [sp(dest)·B·h, s, D]
    rows = B * (H // sp)
    received = all_to_all(send, [rows] * sp, [rows] * sp, group).view(sp, B, H // sp, s, D)  # [sp(src), B, h, s, D]
    return received.permute(1, 2, 0, 3, 4).reshape(B, H // sp, sp * s, D)


def _sequence_to_uneven_head_shards(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uneven head split: KV expanded to one head per query head, then rank ``j`` gets ``head_counts[j]`` heads."""
    sp, rank = group_size(group), group_rank(group)
    B, H, s, D = query.shape
    if key.shape[-1] != D or value.shape[-1] != D:
        raise ValueError("Uneven head splits need q, k and v of the same head dim.")
    groups = H // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)  # [B, H, s, D]
    counts = head_counts(H, sp)
    heads_first = [t.transpose(0, 1) for t in (query, key, value)]  # 3 × [H, B, s, D]
    send = torch.cat([t.narrow(0, sum(counts[:j]), n) for j, n in enumerate(counts) for t in heads_first])
    # send: per destination j, [3·n_j, B, s, D] (its q, k, v heads); received: per source, [3·n_me, B, s, D]
    n_me = counts[rank]
    received = all_to_all(send, [3 * n for n in counts], [3 * n_me] * sp, group)  # [sp·3·n_me, B, s, D]
    received = received.view(sp, 3, n_me, B, s, D).permute(1, 3, 2, 0, 4, 5)  # [3, B, n_me, sp(seq chunk), s, D]
    q, k, v = received.reshape(3, B, n_me, sp * s, D).unbind(0)  # 3 × [B, n_me, S, D]
    return q, k, v


def head_to_sequence_shards(
    attn_output: torch.Tensor, group: dist.ProcessGroup, num_heads: Optional[int] = None
) -> torch.Tensor:
    """Return the attention output to sequence sharding.

    Args:
        attn_output: ``[B, S, hq, D]`` (the layout Hugging Face attention functions return).
        num_heads: total query heads ``Hq`` (needed when heads were split unevenly; default ``hq × sp``).

    Returns:
        ``[B, s, Hq, D]``: this rank's sequence shard with all heads, in head order.
    """
    sp = group_size(group)
    if sp == 1:  # a group of one rank: the sequence is this rank's already
        return attn_output
    B, S, hq, D = attn_output.shape
    s = S // sp
    counts: Sequence[int] = head_counts(num_heads, sp) if num_heads is not None else [hq] * sp
    send = attn_output.view(B, sp, s, hq, D).permute(1, 3, 0, 2, 4)  # [sp(dest = seq chunk), hq, B, s, D]
    received = all_to_all(send.reshape(sp * hq, B, s, D), [hq] * sp, list(counts), group)  # [Hq(src-major), B, s, D]
    return received.permute(1, 2, 0, 3)  # [B, s, Hq, D]


# ----------------------------------------------------------------------------------------------- sequence mixers
def all_gather_sequence(shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, s, ...]`` shards of the SP group -> ``[B, sp·s, ...]``, rank-major along the sequence (not
    differentiable; :func:`gather_sequence_differentiable` is)."""
    sp = group_size(group)
    shard = shard.contiguous()
    pieces = shard.new_empty((sp * shard.shape[0], *shard.shape[1:]))
    dist.all_gather_into_tensor(pieces, shard, group=group)  # [sp·B, s, ...], rank-major
    B, s = shard.shape[:2]
    return pieces.view(sp, B, s, *shard.shape[2:]).transpose(0, 1).reshape(B, sp * s, *shard.shape[2:])


def reduce_scatter_sequence_sum(full: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, S, ...]`` on every rank of the SP group -> this rank's ``[B, S/sp, ...]`` slice of their sum (not
    differentiable; :func:`reduce_scatter_sequence` is)."""
    sp = group_size(group)
    B, S = full.shape[:2]
    s = S // sp
    chunks = full.reshape(B, sp, s, *full.shape[2:]).transpose(0, 1).contiguous()  # [sp, B, s, ...]
    out = full.new_empty((B, s, *full.shape[2:]))
    dist.reduce_scatter_tensor(out, chunks.view(sp * B, s, *full.shape[2:]), group=group)  # [B, s, ...]: summed
    return out


class _GatherSequence(torch.autograd.Function):
    """Forward: ``[B, s, ...]`` shards -> ``[B, S, ...]`` (all-gather); backward: the ``[B, S, ...]`` gradients of the
    group summed, this rank's ``[B, s, ...]`` slice kept (reduce-scatter)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return all_gather_sequence(shard, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return reduce_scatter_sequence_sum(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Forward: ``[B, S, ...]`` partial sums of the group -> this rank's ``[B, S/sp, ...]`` of their sum
    (reduce-scatter); backward: the ``[B, s, ...]`` shard gradients -> ``[B, S, ...]`` (all-gather)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return reduce_scatter_sequence_sum(partial, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return all_gather_sequence(grad, ctx.group), None


def gather_sequence_differentiable(shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, s, ...]`` -> ``[B, S, ...]`` over the SP group, with the reduce-scatter as its backward."""
    return _GatherSequence.apply(shard, group)


def reduce_scatter_sequence(partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, S, ...]`` partial sums -> this rank's ``[B, S/sp, ...]`` of their sum, with the all-gather as its
    backward."""
    return _ReduceScatterSequence.apply(partial, group)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group (same shape in, same shape out); its backward is the same sum of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` summed over the group, differentiable (the gradient is summed over the group too)."""
    return _AllReduceSum.apply(x, group)


# ------------------------------------------------------------------------------- sequence mixers: projected channels
def sequence_to_channel_shards(send: torch.Tensor, counts: Sequence[int], group: dist.ProcessGroup) -> torch.Tensor:
    """A mixer's projected channels from sequence shards to channel shards (differentiable; backward: the reverse).

    Args:
        send: ``[B, s, C]`` this rank's sequence shard of the channels every rank needs, grouped by destination:
            channels ``[sum(counts[:j]), sum(counts[:j + 1]))`` go to rank ``j`` (a channel several ranks need is in
            several groups).
        counts: channels per destination rank (``sum(counts) == C``).

    Returns:
        ``[B, S, counts[rank]]``: this rank's channels over the whole sequence (rank ``j``'s shard at
        ``[j·s, (j + 1)·s)``).
    """
    sp, rank = group_size(group), group_rank(group)
    B, s, C = send.shape
    n = counts[rank]
    rows = send.permute(2, 0, 1)  # [C, B, s]: channel-major, destination groups in rank order
    received = all_to_all(rows, list(counts), [n] * sp, group)  # [sp(src = seq chunk) · n, B, s]
    return received.view(sp, n, B, s).permute(2, 0, 3, 1).reshape(B, sp * s, n)  # [B, S, n]


def channel_to_sequence_shards(held: torch.Tensor, counts: Sequence[int], group: dist.ProcessGroup) -> torch.Tensor:
    """The reverse of :func:`sequence_to_channel_shards`: ``[B, S, counts[rank]]`` (this rank's channels over the
    whole sequence) -> ``[B, s, sum(counts)]``, this rank's sequence shard of every rank's channels in rank order
    (differentiable; backward: the forward exchange)."""
    sp = group_size(group)
    B, S, n = held.shape
    s = S // sp
    send = held.view(B, sp, s, n).permute(1, 3, 0, 2)  # [sp(dest = seq chunk), n, B, s]
    received = all_to_all(send.reshape(sp * n, B, s), [n] * sp, list(counts), group)  # [sum(counts), B, s]
    return received.permute(1, 2, 0)  # [B, s, sum(counts)] (a view: channel-major underneath)
