"""The ring part of hybrid Ulysses × ring sequence parallelism (USP): attention across ring groups.

With ``sp_size = ring_size × ulysses_size`` the SP group is a ``ring × ulysses`` grid, Ulysses innermost; ring
rank ``i`` owns chunks ``i`` and ``2R-1-i`` of the ``2R`` chunks of ``c = S / 2R`` tokens (the zigzag layout of
:mod:`lightning_ulysses.parallel.geometry`, ``R = ring_size``), ``L = S/R`` tokens cut over its Ulysses group.

Around attention the Ulysses all-to-all gives each rank its ring rank's ``L`` tokens for ``H/U`` heads. Ring
attention then passes the key/value blocks around the ring group point to point (``R - 1`` passes forward), and
each rank attends its queries to every block it sees under the causal (and sliding-window) mask of the global
positions with a fused kernel that returns the log-sum-exp (CPU: torch's flash-attention-for-CPU op; CUDA: torch's
memory-efficient attention op, checked once against the matmul kernel: :func:`block_kernel`), merging the
blocks' partial results exactly; no rank ever holds more than two K/V blocks. Backward calls the kernel's backward
per block with the final log-sum-exp and passes the blocks on (``R - 1`` passes, overlapped with compute), their
key/value gradients following them (``R`` passes, overlapped too), so every block's gradient ends with its owner.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_ulysses import _compat
from lightning_ulysses.parallel.geometry import zigzag_positions
from lightning_ulysses.parallel.layout import group_rank, group_size


def _ring_peers(group: dist.ProcessGroup) -> tuple[int, int]:
    """Global ranks of the next and the previous ring rank."""
    R, i = group_size(group), group_rank(group)
    return dist.get_global_rank(group, (i + 1) % R), dist.get_global_rank(group, (i - 1) % R)


def _start_pass(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> tuple[list[Any], list[torch.Tensor]]:
    """Start sending ``tensors`` to the next ring rank and receiving the previous rank's; returns the requests (wait
    on them before reading the received tensors) and the receive buffers."""
    nxt, prev = _ring_peers(group)
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prev, group) for r in received]
    return dist.batch_isend_irecv(ops), received


def causal_window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """``[Lq, Lk]`` causal (and sliding-window) mask on global positions, True = attend."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def _sub_blocks(q_rank: int, k_rank: int, ring_size: int, c: int, window: Optional[int],
                documents: Optional[torch.Tensor] = None, device: Optional[torch.device] = None):
    """The (query slice, key slice, causal, mask) of the parts of a ``[2c, 2c]`` zigzag block that have anything to
    attend to. Plain causal attention: one part per block (this rank's own block is causal as a whole; another
    rank's block is seen entirely by the queries of one chunk or in its first chunk by all queries). With a window
    or packed documents: each ``[c, c]`` sub-block that has anything to attend to, ``causal`` when the two halves are
    the same positions without a window or documents (the kernels' own causal mode), else ``mask`` (``[c, c]``, or
    ``[B, 1, c, c]`` with packed ``documents [B, S]``: True = attend) or ``None`` where every entry is allowed. With
    the zigzag layout about half of the sub-blocks are empty and skipped (with packed documents also those whose
    queries' documents start after their keys). The queries are ring rank ``q_rank``'s, the keys ``k_rank``'s; the
    plain causal parts follow from the two ranks alone (no positions, no host sync), the others from their zigzag
    positions on ``device``."""
    if not window and documents is None:  # plain causal: the zigzag block is one kernel call
        if q_rank == k_rank:  # this rank's own block: positions ascending, exactly causal
            yield slice(0, 2 * c), slice(0, 2 * c), True, None
        elif k_rank < q_rank:  # an earlier ring rank's block: all queries see its first chunk, not its second
            yield slice(0, 2 * c), slice(0, c), False, None
        else:  # a later ring rank's block: only the second query chunk sees it, all of it
            yield slice(c, 2 * c), slice(0, 2 * c), False, None
        return
    q_pos = zigzag_positions(q_rank, ring_size, c, device)
    k_pos = zigzag_positions(k_rank, ring_size, c, device)
    for qh in (0, 1):
        for kh in (0, 1):
            q_half, k_half = q_pos[qh * c:(qh + 1) * c], k_pos[kh * c:(kh + 1) * c]
            mask = causal_window_mask(q_half, k_half, window)
            if documents is not None:  # [B, 1, c, c]: the same document, on global positions
                mask = mask & (documents[:, q_half, None] == documents[:, None, k_half])[:, None]
            if not mask.any():
                continue
            qs, ks = slice(qh * c, (qh + 1) * c), slice(kh * c, (kh + 1) * c)
            if mask.all():
                yield qs, ks, False, None
            elif not window and documents is None and torch.equal(q_half, k_half):
                yield qs, ks, True, None
            else:
                yield qs, ks, False, mask


def document_ids(cu_seqlens: torch.Tensor, batch_size: int, padded_len: int, device: torch.device) -> torch.Tensor:
    """``[B, S]`` index of the packed document of every global position, from the documents' offsets in the
    flattened ``[B × S]`` batch (``cu_seqlens``)."""
    flat = torch.arange(batch_size * padded_len, device=device)
    return (torch.searchsorted(cu_seqlens.to(device=device, dtype=torch.long), flat, right=True) - 1).view(
        batch_size, padded_len)


def _expand_heads(block: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, hkv, L, D] -> [B, hkv·groups, L, D]`` in ``dtype``: each KV head repeated for its query heads."""
    return block.to(dtype) if groups == 1 else block.repeat_interleave(groups, dim=1).to(dtype)


def block_kernel(q: torch.Tensor, v: Optional[torch.Tensor] = None) -> str:
    """The kernel ring attention runs per block for ``q``'s device and dtype: ``"cpu_flash"`` (torch's
    flash-attention-for-CPU op and its backward op), ``"cuda_efficient"`` (torch's memory-efficient attention op and
    its backward op, in ``q``'s dtype), ``"cuda_efficient_fp32"`` (the same op on float32 copies of each block: where
    the op disagrees in a 16-bit dtype and agrees in float32), or ``"matmul"`` (plain matmuls: float64 on CUDA, other
    devices, where no fused op agreed, or value heads of another size than the query/key heads (``v``), which the
    fused ops refuse). A fused op is used only where it gives the matmul kernel's output, log-sum-exp and gradients
    on this device (checked once per device and dtype, :func:`kernel_agrees`); a warning names a fallback."""
    if v is not None and v.shape[-1] != q.shape[-1]:
        return "matmul"
    if (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16)
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")):
        return "cpu_flash"
    if q.device.type == "cuda" and q.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return first_agreeing(["cuda_efficient"] + (["cuda_efficient_fp32"] if q.dtype != torch.float32 else []),
                              q.device, q.dtype)
    return "matmul"


_KERNEL_WORDS = {"cuda_efficient_fp32": "torch's memory-efficient attention op on float32 copies of each block (twice"
                                        " the blocks' bytes, slower matmuls)"}
_WARNED: set[tuple] = set()


def first_agreeing(candidates: list[str], device: torch.device, dtype: torch.dtype) -> str:
    """The first of the fused ``candidates`` that agrees with the matmul kernel on ``device`` in ``dtype``
    (:func:`kernel_agrees`), else ``"matmul"``; a warning (once per device, dtype and candidates) names a fallback
    and why the kernels before it were refused."""
    chosen = next((kernel for kernel in candidates if kernel_agrees(kernel, device, dtype)), "matmul")
    refused = candidates[:candidates.index(chosen)] if chosen in candidates else candidates
    key = (str(device), dtype, tuple(candidates))
    if refused and key not in _WARNED:
        _WARNED.add(key)
        why = "; ".join(f"{k}: {_AGREES[(k, str(torch.device(device)), dtype)][1]}" for k in refused)
        runs = (_KERNEL_WORDS.get(chosen, repr(chosen)) if chosen != "matmul"
                else "the exact matmul kernel (slower; it holds each block's [cq, ck] scores)")
        warnings.warn(f"Ring attention on {device} in {dtype}: {', '.join(map(repr, refused))} disagreed with the"
                      f" matmul kernel ({why}); it runs {runs} instead.", stacklevel=3)
    return chosen


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: Optional[torch.Tensor],
                   scale: float, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, h, cq, D]`` over one key block ``k/v [B, h, ck, D]``: ``(out [B, h, cq, D] normalised
    within the block, lse [B, h, cq])``, ``lse = -inf`` (and ``out = 0``) for queries the block gives nothing.
    ``causal``: the kernel's own (square) causal mask; ``mask``: ``[cq, ck]`` or ``[B, 1, cq, ck]``, True = attend."""
    out, lse = _KERNELS[kernel][0](q, k, v, causal, mask, scale)
    if mask is not None:  # fused ops report lse 0 (or NaN) for a query with no allowed key
        empty = ~mask.any(-1)  # [cq] or [B, 1, cq], over [B, h, cq]
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty[..., None], 0.0)
    return out, lse


def _block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, mask: Optional[torch.Tensor], scale: float,
                    kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one query block × key block from the *final* output and log-sum-exp of the queries (the
    probabilities ``exp(s - lse)`` are the block's share of the whole softmax): ``(dq, dk, dv)``."""
    return _KERNELS[kernel][1](dout, q, k, v, out, lse, causal, mask, scale)


def _cpu_flash_forward(q, k, v, causal, mask, scale):
    additive = None if mask is None else _additive(mask, q.dtype)
    return _compat.cpu_flash_attention(q, k, v, causal, additive, scale)


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, mask, scale):
    additive = None if mask is None else _additive(mask, q.dtype)
    return _compat.cpu_flash_attention_backward(dout, q, k, v, out, lse, causal, additive, scale)


def _aligned_bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``mask`` as the memory-efficient op's additive bias ``[B, h, cq, ck]`` (0 / -inf), rows 16-element aligned
    the way SDPA pads it (the op refuses unaligned bias strides)."""
    (B, h, cq, _), ck = q.shape, k.shape[-2]
    width = -(-ck // 16) * 16
    bias = torch.zeros((*mask.shape[:-1], width), dtype=q.dtype, device=q.device)
    bias[..., :ck].masked_fill_(~mask, float("-inf"))
    return bias[..., :ck].expand(B, h, cq, ck)


def _cuda_efficient_forward(q, k, v, causal, mask, scale):
    bias = None if mask is None else _aligned_bias(mask, q, k)
    out, lse = _compat.efficient_attention(q, k, v, bias, causal, scale)
    return out, lse[..., :q.shape[-2]]  # the op pads lse [B, h, ceil(cq/32)·32]


def _cuda_efficient_backward(dout, q, k, v, out, lse, causal, mask, scale):
    bias = None if mask is None else _aligned_bias(mask, q, k)
    B, h, cq, _ = q.shape
    padded = torch.zeros((B, h, -(-cq // 32) * 32), dtype=torch.float32, device=q.device)  # the op's lse layout
    padded[..., :cq] = lse
    return _compat.efficient_attention_backward(dout, q, k, v, bias, out, padded, causal, scale)


def _cuda_efficient_fp32_forward(q, k, v, causal, mask, scale):
    return _cuda_efficient_forward(q.float(), k.float(), v.float(), causal, mask, scale)  # no copy when float32


def _cuda_efficient_fp32_backward(dout, q, k, v, out, lse, causal, mask, scale):
    return _cuda_efficient_backward(dout.float(), q.float(), k.float(), v.float(), out.float(), lse, causal, mask,
                                    scale)


def _matmul_forward(q, k, v, causal, mask, scale):
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, h, cq, ck]
    allowed = _causal(q.shape[-2], q.device) if causal else mask
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, h, cq]
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - safe[..., None]) @ v, lse


def _matmul_backward(dout, q, k, v, out, lse, causal, mask, scale):
    scores = (q @ k.transpose(-1, -2)) * scale
    probs = torch.exp(scores - lse[..., None])  # [B, h, cq, ck]
    allowed = _causal(q.shape[-2], q.device) if causal else mask
    if allowed is not None:
        probs = probs.masked_fill(~allowed, 0.0)
    delta = (dout * out).sum(-1, keepdim=True)  # [B, h, cq, 1]
    dscores = probs * (dout @ v.transpose(-1, -2) - delta)
    return (dscores @ k) * scale, (dscores.transpose(-1, -2) @ q) * scale, probs.transpose(-1, -2) @ dout


_KERNELS = {"cpu_flash": (_cpu_flash_forward, _cpu_flash_backward),
            "cuda_efficient": (_cuda_efficient_forward, _cuda_efficient_backward),
            "cuda_efficient_fp32": (_cuda_efficient_fp32_forward, _cuda_efficient_fp32_backward),
            "matmul": (_matmul_forward, _matmul_backward)}
_AGREES: dict[tuple[str, str, torch.dtype], tuple[bool, str]] = {}  # (agrees, why)
_KERNEL_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def kernel_agrees(kernel: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` gives the matmul kernel's output, log-sum-exp and gradients on ``device`` for blocks in
    ``dtype`` (once per process; later calls read the verdict). Checked on a causal block, a full block and a masked
    block with queries that see nothing (sizes not multiples of the ops' tiles). A fused op that errors or disagrees
    is not used (:func:`block_kernel` says which kernel runs instead)."""
    key = (kernel, str(torch.device(device)), dtype)
    if key not in _AGREES:
        try:
            error = _kernel_error(kernel, torch.device(device), dtype)
            _AGREES[key] = (error <= _KERNEL_TOLERANCE[dtype], f"relative difference {error:.1e} to the matmul kernel")
        except Exception as exc:  # an op missing or refusing these shapes on this build
            _AGREES[key] = (False, f"{type(exc).__name__}: {exc}")
    return _AGREES[key][0]


def _kernel_error(kernel: str, device: torch.device, dtype: torch.dtype) -> float:
    """Largest difference of ``kernel`` to the matmul kernel (relative to the largest value) over the block shapes
    ring attention uses."""
    g = torch.Generator(device=device).manual_seed(0)
    B, h, c, D = 2, 2, 40, 16
    q, k, v, dout = (torch.randn(B, h, c, D, generator=g, device=device).to(dtype) for _ in range(4))
    pos = torch.arange(c, device=device)
    late = causal_window_mask(pos, pos + c // 2, 7)  # [c, c]: the first half of the queries sees nothing
    exact = torch.float64 if dtype == torch.float64 else torch.float32  # the matmul kernel's precision in the ring
    worst = 0.0
    for causal, mask in ((True, None), (False, None), (False, late), (False, late[None, None].expand(B, 1, c, c))):
        want = _block_forward(*(t.to(exact) for t in (q, k, v)), causal, mask, 0.125, "matmul")
        got = _block_forward(q, k, v, causal, mask, 0.125, kernel)
        # the queries' final softmax as if another block had given each of them weight (every query of a real ring
        # sees itself somewhere): finite log-sum-exp everywhere
        final_lse = torch.logaddexp(want[1], torch.zeros_like(want[1]))
        final_out = (want[0] * torch.exp(want[1] - final_lse)[..., None]).to(dtype)
        grads_want = _block_backward(*(t.to(exact) for t in (dout, q, k, v, final_out)), final_lse, causal, mask,
                                     0.125, "matmul")
        grads_got = _block_backward(dout, q, k, v, final_out, final_lse, causal, mask, 0.125, kernel)
        seen = torch.isfinite(want[1])
        pairs = [(got[0][seen], want[0][seen]), (got[1][seen], want[1][seen]),
                 (got[1][~seen], want[1][~seen])] + list(zip(grads_got, grads_want))
        for a, b in pairs:
            if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
                return float("inf")
            if a.numel() == 0:
                continue
            a, b = a.to(exact).nan_to_num(0.0, 0.0, 0.0), b.to(exact).nan_to_num(0.0, 0.0, 0.0)
            worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item())
    return worst


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _causal(c: int, device: torch.device) -> torch.Tensor:
    return torch.ones(c, c, dtype=torch.bool, device=device).tril()


class _Slices:
    """Slices along the sequence (dim 2) of a ``[B, h, L, ...]`` tensor, each made contiguous once when
    ``contiguous`` (the fused kernels take contiguous inputs, and the same query slices serve several blocks)."""

    __slots__ = ("tensor", "contiguous", "_cut")

    def __init__(self, tensor: torch.Tensor, contiguous: bool) -> None:
        self.tensor, self.contiguous, self._cut = tensor, contiguous, {}

    def __getitem__(self, part: slice) -> torch.Tensor:
        if not self.contiguous:
            return self.tensor[:, :, part]
        key = (part.start, part.stop)
        if key not in self._cut:
            self._cut[key] = self.tensor[:, :, part].contiguous()
        return self._cut[key]


def _fresh(result: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A kernel's fresh ``result`` as an accumulator: in ``dtype``, contiguous (no copy when it already is)."""
    return result.to(dtype).contiguous()


def checked_scale(module: Any, q: torch.Tensor, kwargs: dict[str, Any], switch: str) -> float:
    """transformers' ``scaling`` of an attention call (default ``D ** -0.5``) for the block kernels; attention dropout
    in training and soft-capping, which they do not run, refused naming ``switch``."""
    if kwargs.get("dropout") and getattr(module, "training", False):
        raise ValueError(f"Attention dropout is not supported with {switch}; set the model's attention dropout"
                         " to 0.")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"Attention logit soft-capping is not supported with {switch}.")
    scale = kwargs.get("scaling")
    return float(scale if scale is not None else q.shape[-1] ** -0.5)


def _covers(part: slice, length: int) -> bool:
    """Whether ``part`` (a slice of a sequence of ``length``) is all of it."""
    return (part.start or 0) == 0 and (part.stop is None or part.stop >= length)


def _merge(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one block's ``(out, lse)`` into the running ``(acc, acc_lse)`` (in place): the exact softmax over the
    union of their keys."""
    new = torch.logaddexp(acc_lse, lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    keep = torch.exp(acc_lse - safe)  # exp(-inf) = 0 for an empty running state
    take = torch.exp(lse - safe)
    acc.mul_(keep[..., None]).add_(out.to(acc.dtype) * take[..., None])
    acc_lse.copy_(new)


class _RingAttention(torch.autograd.Function):
    """Ring attention with point-to-point passing of K/V blocks and an exact log-sum-exp merge. Each sub-block runs
    a fused kernel that returns its log-sum-exp (:func:`block_kernel`: torch's flash-attention-for-CPU op on CPU, its
    memory-efficient attention op on CUDA, each with its backward op; the plain matmul path elsewhere); the backward
    pass calls the kernel's backward with the queries' final output and log-sum-exp, so nothing is recomputed twice.
    K/V blocks travel while the current block computes, in forward and in backward; in backward the key/value
    gradients follow each block around the ring and return to its owner. Sub-blocks with nothing to attend to (the
    zigzag layout makes about half of them) are skipped.

    Shapes: ``q [B, hq, L, D]``, ``k/v [B, hkv, L, D]`` (this ring rank's zigzag tokens), output ``[B, hq, L, D]``.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,  # type: ignore[override]
                window: Optional[int], scale: float, documents: Optional[torch.Tensor]) -> torch.Tensor:
        R, i = group_size(group), group_rank(group)
        B, hq, L, D = q.shape
        groups = hq // k.shape[1]
        c = L // 2
        kernel = block_kernel(q)
        # the blocks' dtype: q's for the fused ops that agree in it, float32 (float64) for the others
        kernel_dtype = q.dtype if kernel in ("cpu_flash", "cuda_efficient") else (
            torch.float64 if q.dtype == torch.float64 else torch.float32)
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        if kernel != "matmul":  # the fused kernels and the passes take contiguous blocks: one copy each, here (the
            # projections' [B, s, h, D] views arrive as they are where the Ulysses group has one rank)
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        qk = _Slices(q.to(kernel_dtype), contiguous=kernel != "matmul")
        acc: Optional[torch.Tensor] = None  # the running (out, lse) of every query, from the first block on
        acc_lse: Optional[torch.Tensor] = None
        block_k, block_v = k, v
        for step in range(R):
            owner = (i - step) % R  # whose tokens this K/V block holds
            if step + 1 < R:  # the next block travels while this one is computed
                requests, (next_k, next_v) = _start_pass([block_k, block_v], group)
            kx, vx = _expand_heads(block_k, groups, kernel_dtype), _expand_heads(block_v, groups, kernel_dtype)
            for qs, ks, causal, mask in _sub_blocks(i, owner, R, c, window, documents, q.device):
                out_b, lse_b = _block_forward(qk[qs], kx[:, :, ks], vx[:, :, ks], causal, mask, scale, kernel)
                if acc is None and _covers(qs, L) and mask is None:
                    # the first block every query attends to (this rank's own, causal): the merge into the empty
                    # state would give exactly (out_b, lse_b), so they are the state (contiguous, as the merge's
                    # buffers are: elementwise kernels round alike only on alike layouts)
                    acc, acc_lse = _fresh(out_b, acc_dtype), _fresh(lse_b, acc_dtype)
                    continue
                if acc is None:
                    acc = torch.zeros((B, hq, L, D), dtype=acc_dtype, device=q.device)
                    acc_lse = torch.full((B, hq, L), float("-inf"), dtype=acc_dtype, device=q.device)
                _merge(acc[:, :, qs], acc_lse[:, :, qs], out_b, lse_b.to(acc_dtype))
            if step + 1 < R:
                for request in requests:
                    request.wait()
                block_k, block_v = next_k, next_v
        out = acc.to(kernel_dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.group, ctx.window, ctx.scale, ctx.kernel, ctx.documents = group, window, scale, kernel, documents
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        group, window, scale, kernel, documents = ctx.group, ctx.window, ctx.scale, ctx.kernel, ctx.documents
        R, i = group_size(group), group_rank(group)
        B, hq, L, D = q.shape
        hkv = k.shape[1]
        groups = hq // hkv
        c = L // 2
        kernel_dtype = out.dtype
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        fused = kernel != "matmul"
        qk, dout = _Slices(q.to(kernel_dtype), fused), _Slices(grad_out.to(kernel_dtype), fused)
        out_s = _Slices(out, fused)
        lse_s = _Slices(lse.to(torch.float32) if kernel_dtype != torch.float64 else lse, fused)
        dq: Optional[torch.Tensor] = None
        block_k, block_v = k, v
        grads_in_flight = None  # (requests, [dk, dv]) of the block arriving next
        # With one query head per KV head and one kernel call per block (plain causal attention) each block's key/value
        # gradients are added straight into the gradients that arrive with it; otherwise per block into [B, hq, L, D]
        # buffers first, summed over each KV head's query heads.
        direct = groups == 1 and not window and documents is None
        for step in range(R):
            owner = (i - step) % R
            if step + 1 < R:  # the next K/V block travels while this one is computed
                kv_requests, (next_k, next_v) = _start_pass([block_k, block_v], group)
            kx, vx = _expand_heads(block_k, groups, kernel_dtype), _expand_heads(block_v, groups, kernel_dtype)
            parts = []  # (key slice, dk, dv) of each sub-block
            for qs, ks, causal, mask in _sub_blocks(i, owner, R, c, window, documents, q.device):
                dq_b, dk_b, dv_b = _block_backward(dout[qs], qk[qs], kx[:, :, ks], vx[:, :, ks], out_s[qs],
                                                   lse_s[qs], causal, mask, scale, kernel)
                if dq is None and _covers(qs, L):  # the first block: 0 + dq_b is dq_b
                    dq = _fresh(dq_b, acc_dtype)
                else:
                    if dq is None:
                        dq = torch.zeros((B, hq, L, D), dtype=acc_dtype, device=q.device)
                    dq[:, :, qs] += dq_b
                parts.append((ks, dk_b, dv_b))
            if not direct:
                dk_x = torch.zeros((B, hq, L, D), dtype=acc_dtype, device=q.device)
                dv_x = torch.zeros((B, hq, L, D), dtype=acc_dtype, device=q.device)
                for ks, dk_b, dv_b in parts:
                    dk_x[:, :, ks] += dk_b
                    dv_x[:, :, ks] += dv_b
                parts = [(slice(None), dk_x.view(B, hkv, groups, L, D).sum(2), dv_x.view(B, hkv, groups, L, D).sum(2))]
            if grads_in_flight is not None:  # this block's gradients from the ranks before: arrived meanwhile
                for request in grads_in_flight[0]:
                    request.wait()
                block_dk, block_dv = grads_in_flight[1]  # received buffers: this rank's to add to, then send on
                for ks, dk_b, dv_b in parts:
                    block_dk[:, :, ks] += dk_b
                    block_dv[:, :, ks] += dv_b
            elif len(parts) == 1 and _covers(parts[0][0], L):  # this rank's own block, the first: 0 + dk_b is dk_b
                block_dk, block_dv = _fresh(parts[0][1], acc_dtype), _fresh(parts[0][2], acc_dtype)
            else:  # (the own block in pieces) its gradients start from 0
                block_dk = torch.zeros(k.shape, dtype=acc_dtype, device=q.device)
                block_dv = torch.zeros(v.shape, dtype=acc_dtype, device=q.device)
                for ks, dk_b, dv_b in parts:
                    block_dk[:, :, ks] += dk_b
                    block_dv[:, :, ks] += dv_b
            # the gradients follow their block to the next rank (after R passes they are back with the owner)
            grads_in_flight = _start_pass([block_dk, block_dv], group)
            if step + 1 < R:
                for request in kv_requests:
                    request.wait()
                block_k, block_v = next_k, next_v
        for request in grads_in_flight[0]:  # type: ignore[index]
            request.wait()
        dk, dv = grads_in_flight[1]  # type: ignore[index]
        if dq is None:  # no block gave this rank's queries anything (cannot happen: each sees itself)
            dq = torch.zeros((B, hq, L, D), dtype=acc_dtype, device=q.device)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   window: Optional[int], kwargs: dict[str, Any],
                   documents: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of this ring rank's queries over the whole sequence, K/V blocks passed around the ring.

    Args:
        module: the attention module (its ``training`` flag decides whether dropout would apply).
        q: ``[B, hq, L, D]``, k/v: ``[B, hkv, L, D]``: this ring rank's ``L = 2c`` tokens (chunk ``i`` then chunk
            ``2R-1-i``) for its heads, after the Ulysses exchange.
        group: the ring group (rank ``i`` of it is ring rank ``i``).
        window: the layer's sliding window (``None``: full causal).
        kwargs: transformers' attention keywords: ``scaling`` is used; attention dropout and soft-capping are
            refused.
        documents: ``[B, S]`` packed-document index of every global position (:func:`document_ids`), or ``None``
            (one causal sequence per row).

    Returns:
        ``[B, L, hq, D]`` in the same token order as ``q``.
    """
    scale = checked_scale(module, q, kwargs, "ring_size > 1")
    out = _RingAttention.apply(q, k, v, group, window, float(scale), documents)  # [B, hq, L, D]
    return out.transpose(1, 2)  # [B, L, hq, D]
