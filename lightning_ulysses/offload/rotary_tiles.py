"""The rotary embedding of a whole shard in tiles of positions (Ulysses-Offload).

Hugging Face's attention modules apply rotary embeddings with their modeling module's ``apply_rotary_pos_emb(q, k,
cos, sin, ...)``: ``q * cos + rotate_half(q) * sin``, which holds three query-sized temporaries beside ``q`` at once
(``[s, Hq·D]`` each). With ``offload_attention`` the attention itself no longer holds the whole shard, and that moment,
in each checkpointed layer's recompute, becomes the step's largest (a Llama-3.1-8B at 1M tokens per rank: 7.6
``[s, H]`` tensors, three of them the rotary's temporaries). Here the modeling module's own function runs on tiles of
positions written into one output, and its backward runs tile by tile the same way: one output per input, one tile's
temporaries. The strategy's own attention block calls it (:mod:`lightning_ulysses.offload.attention_block`); the
modeling module's function is not replaced.

Nothing is assumed about the function beyond what is checked, once per function, dtype and layout, on a small random
probe of the call's shapes (on CPU): tiles equal to the whole call to the bit; outputs of the inputs' shapes; and its
gradient with respect to ``q`` and ``k`` the same at the probe's values and at zeros (the backward runs the function on
zeros of each tile, so that nothing of ``q`` or ``k`` is kept: exact for the rotation, which is linear in them, and
refused for anything the check shows is not). A call the check refuses, whose sequence dimension is not clear, or
whose ``cos``/``sin`` need a gradient runs the module's function as it is.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

TILE_BYTES = 64 << 20  # one tile's query bytes at most
FUNCTION_NAME = "apply_rotary_pos_emb"
_PROBE_POSITIONS = 8
_verdicts: dict[tuple, bool] = {}


def _sequence_dim(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Optional[int]:
    """The dimension of ``q`` and ``k`` (``[B, h, S, D]`` or ``[B, S, h, D]``) that ``cos``/``sin`` (``[..., S, D]``)
    run along; ``None`` where it is not one clear dimension."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() not in (2, 3) or cos.shape != sin.shape:
        return None
    length = cos.shape[-2]
    found = [d for d in (1, 2) if q.shape[d] == length and k.shape[d] == length]
    return found[0] if len(found) == 1 else None


def _verified(original: Callable, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, dim: int,
              args: tuple, kwargs: dict) -> bool:
    key = (original, q.dtype, k.dtype, cos.dtype, dim, q.shape[3 - dim], k.shape[3 - dim], q.shape[3], cos.dim())
    if key not in _verdicts:
        try:
            # apart from the caller's step: no dispatch mode (a memory tracker) and no saved-tensor hooks (an offload)
            with torch.utils._python_dispatch._disable_current_modes(), \
                    torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                _verdicts[key] = _probe(original, q, k, cos, dim, args, kwargs)
        except Exception:  # noqa: BLE001 - a function the probe cannot run is left as it is
            _verdicts[key] = False
    return _verdicts[key]


def _probe(original: Callable, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, dim: int, args: tuple,
           kwargs: dict) -> bool:
    generator = torch.Generator().manual_seed(0)

    def like(t: torch.Tensor, positions_dim: int) -> torch.Tensor:
        shape = list(t.shape)
        shape[0] = 1 if t.dim() > 2 else shape[0]
        shape[positions_dim] = _PROBE_POSITIONS
        return torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu").to(t.dtype)  # not meta

    pq, pk, pcos, psin = like(q, dim), like(k, dim), like(cos, cos.dim() - 2), like(cos, cos.dim() - 2)
    whole = original(pq, pk, pcos, psin, *args, **kwargs)
    if not (isinstance(whole, tuple) and len(whole) == 2 and whole[0].shape == pq.shape
            and whole[1].shape == pk.shape):
        return False
    half = _PROBE_POSITIONS // 2
    cut = [original(pq.narrow(dim, a, half), pk.narrow(dim, a, half), pcos.narrow(-2, a, half),
                    psin.narrow(-2, a, half), *args, **kwargs) for a in (0, half)]
    if not all(torch.equal(torch.cat([c[i] for c in cut], dim=dim), whole[i]) for i in (0, 1)):
        return False
    grads = [torch.randn(t.shape, generator=generator, device="cpu").to(t.dtype) for t in whole]

    def gradient(at_q: torch.Tensor, at_k: torch.Tensor) -> tuple:
        at_q, at_k = at_q.detach().requires_grad_(), at_k.detach().requires_grad_()
        with torch.enable_grad():
            out = original(at_q, at_k, pcos, psin, *args, **kwargs)
        return torch.autograd.grad(out, (at_q, at_k), grads)

    at_values, at_zeros = gradient(pq, pk), gradient(torch.zeros_like(pq), torch.zeros_like(pk))
    return all(torch.equal(a, b) for a, b in zip(at_values, at_zeros))


def _bounds(length: int, tile: int) -> list[tuple[int, int]]:
    return [(start, min(tile, length - start)) for start in range(0, length, tile)]


class _TiledRotary(torch.autograd.Function):
    """``original(q, k, cos, sin, *args, **kwargs)`` on tiles of positions along ``dim`` (module docstring); keeps
    ``cos`` and ``sin`` (``[..., S, D]``) for backward, not ``q`` or ``k``."""

    @staticmethod
    def forward(ctx, original: Callable, dim: int, tile: int, extra: tuple,  # type: ignore[override]
                q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        args, kwargs = extra
        ctx.original, ctx.dim, ctx.tile, ctx.extra = original, dim, tile, extra
        ctx.shapes = (q.shape, q.dtype, k.shape, k.dtype)
        ctx.save_for_backward(cos, sin)
        q_out = k_out = None
        for start, width in _bounds(q.shape[dim], tile):
            q_t, k_t = original(q.narrow(dim, start, width), k.narrow(dim, start, width),
                                cos.narrow(-2, start, width), sin.narrow(-2, start, width), *args, **kwargs)
            if q_out is None:  # q's shape and memory layout (a transposed projection stays one), the output dtype
                q_out = torch.empty_like(q, dtype=q_t.dtype)
                k_out = torch.empty_like(k, dtype=k_t.dtype)
            q_out.narrow(dim, start, width).copy_(q_t)
            k_out.narrow(dim, start, width).copy_(k_t)
            del q_t, k_t
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q: Optional[torch.Tensor], grad_k: Optional[torch.Tensor]):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        (q_shape, q_dtype, k_shape, k_dtype), dim, (args, kwargs) = ctx.shapes, ctx.dim, ctx.extra
        device = cos.device
        dq = torch.empty(q_shape, dtype=q_dtype, device=device)
        dk = torch.empty(k_shape, dtype=k_dtype, device=device)
        for start, width in _bounds(q_shape[dim], ctx.tile):
            zq = torch.zeros((*q_shape[:dim], width, *q_shape[dim + 1:]), dtype=q_dtype, device=device,
                             requires_grad=True)
            zk = torch.zeros((*k_shape[:dim], width, *k_shape[dim + 1:]), dtype=k_dtype, device=device,
                             requires_grad=True)
            with torch.enable_grad():  # linear in q and k (checked): the gradient is the same at zeros
                q_t, k_t = ctx.original(zq, zk, cos.narrow(-2, start, width), sin.narrow(-2, start, width), *args,
                                        **kwargs)
            outs = [(t, g.narrow(dim, start, width)) for t, g in ((q_t, grad_q), (k_t, grad_k)) if g is not None]
            torch.autograd.backward([t for t, _ in outs], [g for _, g in outs])
            dq.narrow(dim, start, width).copy_(zq.grad if zq.grad is not None else torch.zeros_like(zq))
            dk.narrow(dim, start, width).copy_(zk.grad if zk.grad is not None else torch.zeros_like(zk))
        return None, None, None, None, dq, dk, None, None


def _tiled(original: Callable) -> Callable:
    @functools.wraps(original)
    def rotary(q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
        tensors = (q, k, cos, sin)
        if not all(isinstance(t, torch.Tensor) for t in tensors) or cos.requires_grad or sin.requires_grad:
            return original(q, k, cos, sin, *args, **kwargs)
        dim = _sequence_dim(q, k, cos, sin)
        if dim is None:
            return original(q, k, cos, sin, *args, **kwargs)
        per_position = q.numel() // q.shape[dim] * q.element_size()
        tile = max(1, TILE_BYTES // max(1, per_position))
        if q.shape[dim] <= tile or not _verified(original, q, k, cos, dim, args, kwargs):
            return original(q, k, cos, sin, *args, **kwargs)
        return _TiledRotary.apply(original, dim, tile, (args, kwargs), q, k, cos, sin)

    rotary._ulysses_tiled_rotary = original  # type: ignore[attr-defined]
    return rotary


_tiled_forms: dict[Callable, Callable] = {}


def tiled(original: Callable) -> Callable:
    """``original`` (a modeling module's ``apply_rotary_pos_emb``) in tiles of positions, where the check allows; the
    owned attention block (:mod:`lightning_ulysses.offload.attention_block`) calls it in place of the function. Nothing
    is replaced in the modeling module."""
    if original not in _tiled_forms:
        _tiled_forms[original] = _tiled(original)
    return _tiled_forms[original]
