"""The ring part of hybrid Ulysses × ring sequence parallelism (USP): attention across ring groups.

With ``sp_size = ring_size × ulysses_size`` the SP group is a ``ring × ulysses`` grid, Ulysses innermost (a
Ulysses group is ``ulysses_size`` consecutive ranks, inside a node). Layout of the full (padded) sequence of
``S`` tokens, cut into ``2R`` chunks of ``c = S / 2R`` (``R = ring_size``, ``U = ulysses_size``):

* ring rank ``i`` owns chunks ``i`` and ``2R-1-i`` ("zigzag"): ``L = S/R`` tokens, so every ring rank has the same
  causal work (an early and a late chunk);
* inside the ring rank's Ulysses group those ``L`` tokens are cut into ``U`` contiguous shards of ``s = S/(R·U)``.

Around attention the Ulysses all-to-all gives each rank its ring rank's ``L`` tokens for ``H/U`` heads. Ring
attention then passes the key/value blocks around the ring group point to point (``R - 1`` passes forward), and
each rank attends its queries to every block it sees under the causal (and sliding-window) mask of the global
positions, merging the blocks' partial results exactly with a running log-sum-exp; no rank ever holds more than
two K/V blocks. Backward recomputes each block's probabilities from the saved log-sum-exp and passes the blocks on
with their key/value gradients (``R`` passes), so every block's gradient ends with its owner.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def padded_length(seq_len: int, ring_size: int, ulysses_size: int) -> int:
    """``S`` padded to a multiple of ``2 × ring_size × ulysses_size`` (``2·ring_size`` chunks, each cut evenly by
    ``ulysses_size``); with ``ring_size = 1`` to a multiple of ``ulysses_size``."""
    unit = ulysses_size * (2 * ring_size if ring_size > 1 else 1)
    return -(-seq_len // unit) * unit


def shard_index(padded_len: int, ring_size: int, ulysses_size: int, ring_rank: int, ulysses_rank: int) -> torch.Tensor:
    """``[s]`` global positions (indices into the padded sequence) that SP rank ``(ring_rank, ulysses_rank)`` holds."""
    if ring_size == 1:
        s = padded_len // ulysses_size
        return torch.arange(ulysses_rank * s, (ulysses_rank + 1) * s)
    c = padded_len // (2 * ring_size)
    mine = torch.cat([torch.arange(ring_rank * c, (ring_rank + 1) * c),
                      torch.arange((2 * ring_size - 1 - ring_rank) * c, (2 * ring_size - ring_rank) * c)])  # [2c]
    s = 2 * c // ulysses_size
    return mine[ulysses_rank * s:(ulysses_rank + 1) * s]


def full_order(padded_len: int, ring_size: int, ulysses_size: int) -> torch.Tensor:
    """``[S]``: for the concatenation of all SP ranks' shards in SP-rank order, the global position of each entry
    (to put gathered shards back in sequence order: ``full[:, order] = gathered``)."""
    return torch.cat([shard_index(padded_len, ring_size, ulysses_size, r, u)
                      for r in range(ring_size) for u in range(ulysses_size)])


def _ring_peers(group: dist.ProcessGroup) -> tuple[int, int]:
    """Global ranks of the next and the previous ring rank."""
    R, i = dist.get_world_size(group), dist.get_rank(group)
    return dist.get_global_rank(group, (i + 1) % R), dist.get_global_rank(group, (i - 1) % R)


def _start_pass(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> tuple[list[Any], list[torch.Tensor]]:
    """Start sending ``tensors`` to the next ring rank and receiving the previous rank's; returns the requests (wait
    on them before reading the received tensors) and the receive buffers."""
    nxt, prev = _ring_peers(group)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prev, group) for r in received]
    return dist.batch_isend_irecv(ops), received


def _pass_around(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Send ``tensors`` to the next ring rank and receive the previous rank's (point-to-point, both at once)."""
    requests, received = _start_pass(tensors, group)
    for request in requests:
        request.wait()
    return received


def _zigzag_positions(rank: int, R: int, c: int, device: torch.device) -> torch.Tensor:
    """``[2c]`` global positions of ring rank ``rank``'s tokens: chunk ``rank`` then chunk ``2R-1-rank``."""
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * R - 1 - rank) * c, (2 * R - rank) * c, device=device)])


def causal_window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """``[Lq, Lk]`` causal (and sliding-window) mask on global positions, True = attend."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def _sub_blocks(q_pos: torch.Tensor, k_pos: torch.Tensor, c: int, window: Optional[int]):
    """The (query half, key half, mask or None) pairs of a ``[2c, 2c]`` block that have anything to attend to; the
    mask is ``None`` where every entry is allowed. With the zigzag layout about half of the sub-blocks are empty."""
    for qh in (0, 1):
        for kh in (0, 1):
            mask = causal_window_mask(q_pos[qh * c:(qh + 1) * c], k_pos[kh * c:(kh + 1) * c], window)
            if mask.any():
                yield slice(qh * c, (qh + 1) * c), slice(kh * c, (kh + 1) * c), None if mask.all() else mask


def _expand_heads(block: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, hkv, L, D] -> [B, hkv·groups, L, D]`` in ``dtype``: each KV head repeated for its query heads."""
    return block.repeat_interleave(groups, dim=1).to(dtype)


class _RingAttention(torch.autograd.Function):
    """Ring attention with point-to-point passing of K/V blocks and an exact log-sum-exp merge; the backward pass
    recomputes each block's probabilities from the saved log-sum-exp and passes the blocks' key/value gradients
    around the ring with them, so each returns to its owner after a full round. Sub-blocks with nothing to attend
    to (the zigzag layout makes about half of them) are skipped.

    Shapes: ``q [B, hq, L, D]``, ``k/v [B, hkv, L, D]`` (this ring rank's zigzag tokens), output ``[B, hq, L, D]``.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,  # type: ignore[override]
                window: Optional[int], scale: float) -> torch.Tensor:
        R, i = dist.get_world_size(group), dist.get_rank(group)
        B, hq, L, D = q.shape
        groups = hq // k.shape[1]
        c = L // 2
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        qf = q.to(acc_dtype)
        q_pos = _zigzag_positions(i, R, c, q.device)
        running_max = torch.full((B, hq, L), float("-inf"), dtype=acc_dtype, device=q.device)
        running_sum = torch.zeros((B, hq, L), dtype=acc_dtype, device=q.device)
        acc = torch.zeros((B, hq, L, D), dtype=acc_dtype, device=q.device)
        block_k, block_v = k, v
        for step in range(R):
            owner = (i - step) % R  # whose tokens this K/V block holds
            if step + 1 < R:  # the next block travels while this one is computed
                requests, (next_k, next_v) = _start_pass([block_k, block_v], group)
            kx, vx = _expand_heads(block_k, groups, acc_dtype), _expand_heads(block_v, groups, acc_dtype)  # [B,hq,L,D]
            for qs, ks, mask in _sub_blocks(q_pos, _zigzag_positions(owner, R, c, q.device), c, window):
                scores = (qf[:, :, qs] @ kx[:, :, ks].transpose(-1, -2)) * scale  # [B, hq, c, c]
                if mask is not None:
                    scores = scores.masked_fill(~mask, float("-inf"))
                old_max = running_max[:, :, qs]
                new_max = torch.maximum(old_max, scores.amax(-1))
                safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
                probs = torch.exp(scores - safe_max[..., None])  # masked entries: exp(-inf) = 0
                correction = torch.where(torch.isinf(old_max), torch.zeros_like(old_max),
                                         torch.exp(old_max - safe_max))
                running_sum[:, :, qs] = running_sum[:, :, qs] * correction + probs.sum(-1)
                acc[:, :, qs] = acc[:, :, qs] * correction[..., None] + probs @ vx[:, :, ks]
                running_max[:, :, qs] = new_max
            if step + 1 < R:
                for request in requests:
                    request.wait()
                block_k, block_v = next_k, next_v
        tiny = torch.finfo(acc_dtype).tiny
        out = acc / running_sum.clamp(min=tiny)[..., None]
        lse = running_max + torch.log(running_sum.clamp(min=tiny))  # [B, hq, L]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.window, ctx.scale = group, window, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        group, window, scale = ctx.group, ctx.window, ctx.scale
        R, i = dist.get_world_size(group), dist.get_rank(group)
        B, hq, L, D = q.shape
        hkv = k.shape[1]
        groups = hq // hkv
        c = L // 2
        acc_dtype = out.dtype
        qf, dout = q.to(acc_dtype), grad_out.to(acc_dtype)
        delta = (dout * out).sum(-1)  # [B, hq, L]
        q_pos = _zigzag_positions(i, R, c, q.device)
        dq = torch.zeros_like(qf)
        block = [k, v, torch.zeros_like(k, dtype=acc_dtype), torch.zeros_like(v, dtype=acc_dtype)]
        for step in range(R):
            owner = (i - step) % R
            block_k, block_v, block_dk, block_dv = block
            kx, vx = _expand_heads(block_k, groups, acc_dtype), _expand_heads(block_v, groups, acc_dtype)
            dk_x, dv_x = torch.zeros_like(kx), torch.zeros_like(vx)  # [B, hq, L, D]
            for qs, ks, mask in _sub_blocks(q_pos, _zigzag_positions(owner, R, c, q.device), c, window):
                scores = (qf[:, :, qs] @ kx[:, :, ks].transpose(-1, -2)) * scale
                probs = torch.exp(scores - lse[:, :, qs, None])  # [B, hq, c, c]
                if mask is not None:
                    probs = probs.masked_fill(~mask, 0.0)
                dv_x[:, :, ks] += probs.transpose(-1, -2) @ dout[:, :, qs]
                dscores = probs * (dout[:, :, qs] @ vx[:, :, ks].transpose(-1, -2) - delta[:, :, qs, None])
                dq[:, :, qs] += (dscores @ kx[:, :, ks]) * scale
                dk_x[:, :, ks] += (dscores.transpose(-1, -2) @ qf[:, :, qs]) * scale
            block_dk = block_dk + dk_x.view(B, hkv, groups, L, D).sum(2)
            block_dv = block_dv + dv_x.view(B, hkv, groups, L, D).sum(2)
            # pass the block on with its gradients; after R passes each block is back with its owner
            block = _pass_around([block_k, block_v, block_dk, block_dv], group)
        return dq.to(q.dtype), block[2].to(k.dtype), block[3].to(v.dtype), None, None, None


def ring_attention(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   window: Optional[int], kwargs: dict[str, Any]) -> torch.Tensor:
    """Causal attention of this ring rank's queries over the whole sequence, K/V blocks passed around the ring.

    Args:
        module: the attention module (its ``training`` flag decides whether dropout would apply).
        q: ``[B, hq, L, D]``, k/v: ``[B, hkv, L, D]``: this ring rank's ``L = 2c`` tokens (chunk ``i`` then chunk
            ``2R-1-i``) for its heads, after the Ulysses exchange.
        group: the ring group (rank ``i`` of it is ring rank ``i``).
        window: the layer's sliding window (``None``: full causal).
        kwargs: transformers' attention keywords: ``scaling`` is used; attention dropout and soft-capping are
            refused.

    Returns:
        ``[B, L, hq, D]`` in the same token order as ``q``.
    """
    if kwargs.get("dropout") and getattr(module, "training", False):
        raise ValueError("Attention dropout is not supported with ring_size > 1; set the model's attention dropout"
                         " to 0.")
    if kwargs.get("softcap") is not None:
        raise ValueError("Attention logit soft-capping is not supported with ring_size > 1.")
    scale = kwargs.get("scaling")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out = _RingAttention.apply(q, k, v, group, window, float(scale))  # [B, hq, L, D]
    return out.transpose(1, 2)  # [B, L, hq, D]
