"""Ulysses-Offload: attention over chunks of the gathered sequence, the chunks not in use in host memory.

After the Ulysses all-to-all a rank holds the whole sequence ``S`` for its ``h = H / sp`` heads. Here that sequence
is cut into chunks of ``c`` positions; each query chunk attends to the key chunks it may see (causal, a sliding
window, packed documents: the ring's block masks on global positions) with the ring's fused block kernels, merging
the blocks' partial results exactly by their log-sum-exps (:mod:`lightning_ulysses.parallel.ring`). Between the
forward and the backward pass the tensors backward needs (each chunk's q, k, v, output and log-sum-exp) wait in a
:class:`ChunkStore`: on CUDA in pinned host memory, copied on a side stream so that a copy overlaps the next
chunk's compute, and brought back one chunk ahead in backward; on other devices there is no host to move to and
they stay where they are (the chunking still runs, exactly). The backward pass goes over the same (query chunk, key
chunk) pairs with the kernels' backward ops and the final log-sum-exp, so nothing is recomputed twice.

Shapes: ``q [B, hq, S, D]``, ``k/v [B, hkv, S, D]`` (``hq`` a multiple of ``hkv``), output ``[B, hq, S, D]``.
DeepSpeed's own layer (``deepspeed/sequence/fpdt_layer.py``) and why this one is not built on it:
docs/ulysses-offload.md.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Union

import torch

from lightning_ulysses.parallel.ring import (_block_backward, _block_forward, _expand_heads, _merge,
                                             block_kernel, causal_window_mask)

AUTO_CHUNK = 16384  # positions per chunk for offload_attention=True / "auto"
OffloadSetting = Union[bool, int, str]


def chunk_length(setting: OffloadSetting) -> Optional[int]:
    """Positions per chunk for the strategy's ``offload_attention`` (``None``: off)."""
    if setting is False or setting is None or setting == 0:
        return None
    if setting is True or setting == "auto":
        return AUTO_CHUNK
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"offload_attention={setting!r}: pass True or 'auto' (chunks of {AUTO_CHUNK} positions), a"
                         " number of positions per chunk, or False.")
    return setting


class ChunkStore:
    """Where a chunk waits between the forward and the backward pass: on CUDA a pinned host copy made on a side
    stream (the device copy is freed once the copy is done), on other devices the tensor itself."""

    def __init__(self, device: torch.device) -> None:
        self.offloads = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.offloads else None

    def put(self, tensor: torch.Tensor) -> Any:
        if not self.offloads:
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the chunk is computed
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        tensor.record_stream(self.stream)  # the device copy is not reused before the copy has read it
        return host, done, tensor.device

    def fetch(self, handle: Any) -> Any:
        """Start bringing a chunk back (on the side stream); :meth:`ready` waits for it."""
        if not self.offloads:
            return handle
        host, done, device = handle
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(done)
            back = host.to(device, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.stream)
        return back, arrived

    def ready(self, fetched: Any) -> torch.Tensor:
        if not self.offloads:
            return fetched
        back, arrived = fetched
        torch.cuda.current_stream(back.device).wait_event(arrived)
        back.record_stream(torch.cuda.current_stream(back.device))
        return back


def _bounds(length: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk, length)) for start in range(0, length, chunk)]


def _blocks(bounds: list[tuple[int, int]], i: int, window: Optional[int], documents: Optional[torch.Tensor],
            device: torch.device) -> Iterator[tuple[int, bool, Optional[torch.Tensor]]]:
    """The key chunks query chunk ``i`` attends to, each with ``(j, causal, mask)``: ``causal`` the kernel's own
    square causal mask (the diagonal chunk without a window or documents), else ``mask`` (``[cq, ck]``, or
    ``[B, 1, cq, ck]`` with packed ``documents [B, S]``; True = attend) or ``None`` where every pair may attend.
    Chunks no query of chunk ``i`` may see (later ones, those past the window, other documents) are skipped."""
    qa, qb = bounds[i]
    for j in range(i + 1):
        ka, kb = bounds[j]
        if window is not None and kb - 1 <= qa - window:  # every key of the chunk is out of every query's window
            continue
        plain = documents is None and (window is None or (qb - 1) - ka < window)  # every pair within the window
        if plain:
            yield j, i == j, None
            continue
        q_pos = torch.arange(qa, qb, device=device)
        k_pos = torch.arange(ka, kb, device=device)
        mask = causal_window_mask(q_pos, k_pos, window)  # [cq, ck]
        if documents is not None:
            mask = mask & (documents[:, qa:qb, None] == documents[:, None, ka:kb])[:, None]  # [B, 1, cq, ck]
        if not mask.any():
            continue
        yield j, False, (None if mask.all() else mask)


class _OffloadedAttention(torch.autograd.Function):
    """Chunked attention (module docstring); the chunks backward needs wait in a :class:`ChunkStore`."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int,  # type: ignore[override]
                window: Optional[int], scale: float, documents: Optional[torch.Tensor]) -> torch.Tensor:
        B, hq, S, D = q.shape
        groups = hq // k.shape[1]
        kernel = block_kernel(q, v)
        kernel_dtype = q.dtype if kernel in ("cpu_flash", "cuda_efficient") else (
            torch.float64 if q.dtype == torch.float64 else torch.float32)
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        bounds = _bounds(S, chunk)
        store = ChunkStore(q.device)
        out = q.new_empty((B, S, hq, v.shape[-1])).transpose(1, 2)  # [B, hq, S, Dv] over the caller's layout
        saved = {"q": [], "k": [], "v": [], "out": [], "lse": []}
        for j, (ka, kb) in enumerate(bounds):  # every chunk's k and v wait in the store once, as they are
            saved["k"].append(store.put(k[:, :, ka:kb].contiguous()))
            saved["v"].append(store.put(v[:, :, ka:kb].contiguous()))
        for i, (qa, qb) in enumerate(bounds):
            q_i = q[:, :, qa:qb].to(kernel_dtype).contiguous()  # [B, hq, cq, D]
            acc: Optional[torch.Tensor] = None
            acc_lse: Optional[torch.Tensor] = None
            for j, causal, mask in _blocks(bounds, i, window, documents, q.device):
                ka, kb = bounds[j]
                k_j = _expand_heads(k[:, :, ka:kb], groups, kernel_dtype).contiguous()  # [B, hq, ck, D]
                v_j = _expand_heads(v[:, :, ka:kb], groups, kernel_dtype).contiguous()
                out_b, lse_b = _block_forward(q_i, k_j, v_j, causal, mask, scale, kernel)
                if acc is None:
                    acc = torch.zeros((B, hq, qb - qa, v.shape[-1]), dtype=acc_dtype, device=q.device)
                    acc_lse = torch.full((B, hq, qb - qa), float("-inf"), dtype=acc_dtype, device=q.device)
                _merge(acc, acc_lse, out_b, lse_b.to(acc_dtype))
            out_i = acc.to(kernel_dtype)  # [B, hq, cq, Dv]: every query sees at least itself
            out[:, :, qa:qb] = out_i.to(out.dtype)
            saved["q"].append(store.put(q_i))
            saved["out"].append(store.put(out_i))
            saved["lse"].append(store.put(acc_lse.to(torch.float32) if kernel_dtype != torch.float64 else acc_lse))
        ctx.store, ctx.saved, ctx.bounds = store, saved, bounds
        ctx.meta = (window, scale, kernel, kernel_dtype, acc_dtype, groups, q.dtype, k.dtype, v.dtype, tuple(k.shape))
        ctx.documents = documents
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        store, saved, bounds = ctx.store, ctx.saved, ctx.bounds
        window, scale, kernel, kernel_dtype, acc_dtype, groups, q_dtype, k_dtype, v_dtype, k_shape = ctx.meta
        B, hq, S, Dv = grad_out.shape
        hkv = k_shape[1]
        device = grad_out.device
        dq = torch.zeros((B, hq, S, k_shape[-1]), dtype=acc_dtype, device=device)
        dk = torch.zeros(k_shape, dtype=acc_dtype, device=device)
        dv = torch.zeros((B, hkv, S, Dv), dtype=acc_dtype, device=device)
        for i, (qa, qb) in enumerate(bounds):
            q_i, out_i, lse_i = (store.ready(store.fetch(saved[name][i])) for name in ("q", "out", "lse"))
            dout_i = grad_out[:, :, qa:qb].to(kernel_dtype).contiguous()
            pairs = list(_blocks(bounds, i, window, ctx.documents, device))
            incoming = store.fetch(saved["k"][pairs[0][0]]), store.fetch(saved["v"][pairs[0][0]])
            for n, (j, causal, mask) in enumerate(pairs):
                k_j, v_j = store.ready(incoming[0]), store.ready(incoming[1])
                if n + 1 < len(pairs):  # the next key chunk travels while this one is computed
                    nxt = pairs[n + 1][0]
                    incoming = store.fetch(saved["k"][nxt]), store.fetch(saved["v"][nxt])
                ka, kb = bounds[j]
                kx = _expand_heads(k_j, groups, kernel_dtype).contiguous()
                vx = _expand_heads(v_j, groups, kernel_dtype).contiguous()
                dq_b, dk_b, dv_b = _block_backward(dout_i, q_i, kx, vx, out_i, lse_i, causal, mask, scale, kernel)
                dq[:, :, qa:qb] += dq_b
                dk[:, :, ka:kb] += dk_b.view(B, hkv, groups, kb - ka, -1).sum(2)
                dv[:, :, ka:kb] += dv_b.view(B, hkv, groups, kb - ka, -1).sum(2)
        ctx.saved = None
        return dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), None, None, None, None


def offloaded_attention(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int,
                        window: Optional[int], kwargs: dict[str, Any],
                        documents: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention over the whole gathered sequence in chunks of ``chunk`` positions (module docstring).

    Args:
        module: the attention module (its ``training`` flag decides whether dropout would apply).
        q: ``[B, hq, S, D]``, k/v: ``[B, hkv, S, D]``: the whole sequence for this rank's heads, after the exchange.
        chunk: positions per chunk.
        window: the layer's sliding window (``None``: full causal).
        kwargs: transformers' attention keywords: ``scaling`` is used; attention dropout and soft-capping are
            refused.
        documents: ``[B, S]`` packed-document index of every position, or ``None``.

    Returns:
        ``[B, S, hq, D]``.
    """
    if kwargs.get("dropout") and getattr(module, "training", False):
        raise ValueError("Attention dropout is not supported with offload_attention; set the model's attention"
                         " dropout to 0.")
    if kwargs.get("softcap") is not None:
        raise ValueError("Attention logit soft-capping is not supported with offload_attention.")
    scale = kwargs.get("scaling")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out = _OffloadedAttention.apply(q, k, v, chunk, window, float(scale), documents)  # [B, hq, S, D]
    return out.transpose(1, 2)  # [B, S, hq, D]
