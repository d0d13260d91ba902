"""The ring part of hybrid Ulysses × ring sequence parallelism (USP): attention across ring groups.

With ``sp_size = ring_size × ulysses_size`` the SP group is a ``ring × ulysses`` grid, Ulysses innermost (a
Ulysses group is ``ulysses_size`` consecutive ranks, inside a node). Layout of the full (padded) sequence of
``S`` tokens, cut into ``2R`` chunks of ``c = S / 2R`` (``R = ring_size``, ``U = ulysses_size``):

* ring rank ``i`` owns chunks ``i`` and ``2R-1-i`` ("zigzag"): ``L = S/R`` tokens, so every ring rank has the same
  causal work (an early and a late chunk);
* inside the ring rank's Ulysses group those ``L`` tokens are cut into ``U`` contiguous shards of ``s = S/(R·U)``.

Around attention the Ulysses all-to-all gives each rank its ring rank's ``L`` tokens for ``H/U`` heads. The ring
step then gathers the keys and values of all ``R`` ring ranks (``[B, h, S, D]``, all-gather over the ring group,
Llama-3-style context parallelism: the same volume a ring of point-to-point sends moves, without the overlap), and
each query chunk attends causally to the keys up to its own global position. The backward pass is autograd's: the
gather's adjoint sums every ring rank's key/value gradients back to their owners (a reduce-scatter).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_ulysses.exchange import all_to_all


def padded_length(seq_len: int, ring_size: int, ulysses_size: int) -> int:
    """``S`` padded so that it splits into ``2·ring_size`` chunks, each cut evenly by ``ulysses_size``... i.e. a
    multiple of ``2 × ring_size × ulysses_size`` (with ``ring_size = 1``: of ``ulysses_size``)."""
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


def gather_ring(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-gather along dim 0 over ``group``: ``[n, ...] -> [R·n, ...]`` (rank-major). Its backward
    sums the gradients of every rank's copy back to the owner (an all-to-all of the gradient blocks, then the sum
    over the copies)."""
    R = dist.get_world_size(group)
    n = x.shape[0]
    copies = x.unsqueeze(0).expand(R, *x.shape).reshape(R * n, *x.shape[1:])  # [R·n, ...]: one copy per rank
    return all_to_all(copies, [n] * R, [n] * R, group)  # [R·n, ...]: block j from rank j


def ring_attention(inner: Callable[..., Any], module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup, window: Optional[int], kwargs: dict[str, Any]) -> torch.Tensor:
    """Causal attention of this ring rank's queries over the whole sequence.

    Args:
        inner: transformers' ``sdpa`` attention function (``inner(module, q, k, v, mask, **kwargs)``).
        q: ``[B, hq, L, D]``, k/v: ``[B, hkv, L, D]``: this ring rank's ``L = 2c`` tokens (chunk ``i`` then chunk
            ``2R-1-i``) for its heads, after the Ulysses exchange.
        group: the ring group (rank ``i`` of it is ring rank ``i``).
        window: the layer's sliding window (``None``: full causal).

    Returns:
        ``[B, L, hq, D]`` in the same token order as ``q``.
    """
    R, i = dist.get_world_size(group), dist.get_rank(group)
    B, hkv, L, D = k.shape
    c = L // 2
    kv = gather_ring(torch.stack([k, v]).transpose(0, 1).reshape(B * 2, hkv, L, D), group)  # [R·2B, hkv, L, D]
    kv = kv.view(R, B, 2, hkv, L, D)
    chunks: list[Optional[torch.Tensor]] = [None] * (2 * R)
    for j in range(R):  # ring rank j holds chunk j, then chunk 2R-1-j
        chunks[j], chunks[2 * R - 1 - j] = kv[j, ..., :c, :], kv[j, ..., c:, :]
    full = torch.cat(chunks, dim=-2)  # type: ignore[arg-type]  # [B, 2, hkv, S, D] in sequence order
    keys, values = full[:, 0], full[:, 1]  # [B, hkv, S, D]
    outputs = []
    for half, chunk in ((0, i), (1, 2 * R - 1 - i)):
        start = chunk * c  # global position of this query chunk's first token
        first_key = max(0, start - window + 1) if window else 0
        last_key = start + c  # causal: no key after the chunk's last query
        query_pos = torch.arange(start, start + c, device=q.device)[:, None]  # [c, 1]
        key_pos = torch.arange(first_key, last_key, device=q.device)[None, :]  # [1, k]
        mask = key_pos <= query_pos
        if window:
            mask &= key_pos > query_pos - window
        out = inner(module, q[:, :, half * c:(half + 1) * c], keys[:, :, first_key:last_key],
                    values[:, :, first_key:last_key], mask[None, None], **kwargs)[0]  # [B, c, hq, D]
        outputs.append(out)
    return torch.cat(outputs, dim=1)  # [B, L, hq, D]
