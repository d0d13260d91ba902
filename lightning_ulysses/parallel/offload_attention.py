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

from collections import deque
from typing import Any, Iterator, Optional, Union

import torch

from lightning_ulysses.parallel.ring import (_block_backward, _block_forward, _expand_heads, _merge,
                                             block_kernel, causal_window_mask, checked_scale)

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


COPIES_IN_FLIGHT = 6  # device-to-host copies the host may queue ahead of the copy stream (about one chunk's five)


class CopyWindow:
    """At most ``limit`` device-to-host copies queued ahead of the copy stream (over every store of a device).

    A device tensor handed to a copy (``record_stream``) goes back to the caching allocator only once the copy
    stream has finished everything queued before its release. CUDA launches are asynchronous, so a host running
    ahead of the GPU queues every chunk of every layer, and each chunk's device copy stays reserved until its copy
    drains: the memory the store exists to free. Measured on an H100 before this bound (sp 1, 32K tokens, bf16): the
    allocator reserved 79.7 GB for a 42.0 GB allocated peak (37.7 GB over it; plain attention 4.0 GB). Here the host
    waits for the oldest copy past the limit (``events``: anything with CUDA events' ``query()`` and
    ``synchronize()``)."""

    def __init__(self, limit: int = COPIES_IN_FLIGHT) -> None:
        self.limit, self.events = limit, deque()

    def add(self, event: Any) -> None:
        self.events.append(event)
        while self.events and self.events[0].query():  # done: nothing to wait for
            self.events.popleft()
        while len(self.events) > self.limit:
            self.events.popleft().synchronize()


_COPY_STREAMS: dict[torch.device, tuple[Any, CopyWindow]] = {}


def _copy_stream(device: torch.device) -> tuple[Any, CopyWindow]:
    """One side stream per device for every store's copies (first in, first out across layers), and its window."""
    device = torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device())
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = (torch.cuda.Stream(device), CopyWindow())
    return _COPY_STREAMS[device]


class ChunkStore:
    """Where a chunk waits between the forward and the backward pass: on CUDA a pinned host copy made on a side
    stream (the device copy is freed once the copy is done; :class:`CopyWindow` bounds the copies in flight), on
    other devices the tensor itself. A fetched chunk is allocated on the compute stream (its blocks return to the
    compute stream's pool, not the side stream's) and filled on the side stream."""

    def __init__(self, device: torch.device) -> None:
        self.offloads = device.type == "cuda"
        self.stream, self.window = _copy_stream(device) if self.offloads else (None, None)

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
        self.window.add(done)
        return host, done, tensor.device

    def fetch(self, handle: Any) -> Any:
        """Start bringing a chunk back (on the side stream); :meth:`ready` waits for it."""
        if not self.offloads:
            return handle
        host, done, device = handle
        compute = torch.cuda.current_stream(device)
        back = torch.empty(host.shape, dtype=host.dtype, device=device)  # from the compute stream's pool
        self.stream.wait_stream(compute)  # the block's earlier users on the compute stream are done with it
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(done)
            back.copy_(host, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.stream)
        return back, arrived

    def ready(self, fetched: Any) -> torch.Tensor:
        if not self.offloads:
            return fetched
        back, arrived = fetched
        torch.cuda.current_stream(back.device).wait_event(arrived)  # the copy has landed before any use
        return back

    def release(self, handle: Any) -> None:
        """A stored chunk that will not be fetched again (an accumulator stored anew): its host copy goes with the
        last reference to ``handle``; nothing to wait for."""


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
                window: Optional[int], scale: float, documents: Optional[torch.Tensor], keep: bool) -> torch.Tensor:
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
        for j, (ka, kb) in enumerate(bounds if keep else ()):  # every chunk's k and v wait in the store once
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
            out_i = acc.to(q.dtype)  # [B, hq, cq, Dv]: every query sees at least itself
            out[:, :, qa:qb] = out_i
            if not keep:  # no backward will run (a forward without a graph): nothing to store
                continue
            # q and the output wait in the input's dtype (a kernel on float32 copies converts them back): half the
            # host bytes in 16 bits; backward reads the output as the caller got it, as a flash kernel does
            saved["q"].append(store.put(q[:, :, qa:qb].contiguous()))
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
        device = grad_out.device
        dq = torch.empty((B, hq, S, k_shape[-1]), dtype=q_dtype, device=device)
        # each key chunk's gradients, [B, hkv, c, D] in the accumulation dtype, wait in the store between the query
        # chunks that add to them (none held for the whole sequence)
        saved["dk"], saved["dv"] = [None] * len(bounds), [None] * len(bounds)
        for i, (qa, qb) in enumerate(bounds):
            q_i, out_i = (store.ready(store.fetch(saved[name][i])).to(kernel_dtype) for name in ("q", "out"))
            lse_i = store.ready(store.fetch(saved["lse"][i]))
            dout_i = grad_out[:, :, qa:qb].to(kernel_dtype).contiguous()  # [B, hq, cq, Dv]
            dq_i = torch.zeros(q_i.shape, dtype=acc_dtype, device=device)
            blocks_of = ((j, slice(None), slice(None), causal, mask)
                         for j, causal, mask in _blocks(bounds, i, window, ctx.documents, device))
            for j, blocks, k_j, v_j, dk_j, dv_j in _key_chunks(store, saved, blocks_of, gradients=acc_dtype):
                (_, _, causal, mask), = blocks
                kx, vx = _expand_heads(k_j, groups, kernel_dtype), _expand_heads(v_j, groups, kernel_dtype)
                dq_b, dk_b, dv_b = _block_backward(dout_i, q_i, kx, vx, out_i, lse_i, causal, mask, scale, kernel)
                hkv, width = dk_j.shape[1], dk_j.shape[2]
                dq_i += dq_b
                dk_j += dk_b.view(B, hkv, groups, width, -1).sum(2)
                dv_j += dv_b.view(B, hkv, groups, width, -1).sum(2)
                for name, grad in (("dk", dk_j), ("dv", dv_j)):
                    if saved[name][j] is not None:
                        store.release(saved[name][j])
                    saved[name][j] = store.put(grad)
            dq[:, :, qa:qb] = dq_i.to(q_dtype)
        dk = torch.empty(k_shape, dtype=k_dtype, device=device)
        dv = torch.empty((*k_shape[:3], Dv), dtype=v_dtype, device=device)
        incoming = store.fetch(saved["dk"][0]), store.fetch(saved["dv"][0])
        for j, (ka, kb) in enumerate(bounds):  # every key chunk's gradients into the caller's dtype
            dk_j, dv_j = store.ready(incoming[0]), store.ready(incoming[1])  # [B, hkv, c, D]
            if j + 1 < len(bounds):  # the next chunk's gradients travel while this one is copied
                incoming = store.fetch(saved["dk"][j + 1]), store.fetch(saved["dv"][j + 1])
            dk[:, :, ka:kb], dv[:, :, ka:kb] = dk_j, dv_j
        ctx.saved = None
        return dq, dk, dv, None, None, None, None, None


def _checked_scale(module: Any, q: torch.Tensor, kwargs: dict[str, Any]) -> float:
    return checked_scale(module, q, kwargs, "offload_attention")


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
    scale = _checked_scale(module, q, kwargs)
    out = _OffloadedAttention.apply(q, k, v, chunk, window, scale, documents, _backward_follows(q, k, v))
    return out.transpose(1, 2)  # [B, S, hq, D]


# ------------------------------------------------------------------------------ the exchange per chunk (FPDT's layout)
def _to_head_shards(pieces: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """One all-to-all for several ``[B, Ht, p, D]`` pieces of this rank's shard (``Ht`` divisible by ``sp``): each
    becomes ``[B, Ht/sp, sp·p, D]``, this rank's heads for every rank's piece, rank-major."""
    from lightning_ulysses.parallel.exchange import _all_to_all
    from lightning_ulysses.parallel.layout import group_size

    sp = group_size(group)
    B, _, p, D = pieces[0].shape
    heads = [t.shape[1] // sp for t in pieces]
    packed = torch.cat([t.reshape(B, sp, h, p, D) for t, h in zip(pieces, heads)], dim=2)  # [B, sp(dest), Σh, p, D]
    rows = B * sum(heads)
    received = _all_to_all(packed.transpose(0, 1).reshape(sp * rows, p, D), [rows] * sp, [rows] * sp, group)
    full = received.view(sp, B, sum(heads), p, D).permute(1, 2, 0, 3, 4).reshape(B, sum(heads), sp * p, D)
    return list(full.split(heads, dim=1))  # each [B, Ht/sp, sp·p, D]


def _to_sequence_shards(chunks: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """The adjoint of :func:`_to_head_shards`: ``[B, h, sp·p, D]`` (this rank's heads of every rank's piece) ->
    ``[B, h·sp, p, D]`` (every head of this rank's piece)."""
    from lightning_ulysses.parallel.exchange import _all_to_all
    from lightning_ulysses.parallel.layout import group_size

    sp = group_size(group)
    B, _, width, D = chunks[0].shape
    p = width // sp
    heads = [t.shape[1] for t in chunks]
    packed = torch.cat([t.reshape(B, h, sp, p, D) for t, h in zip(chunks, heads)], dim=1)  # [B, Σh, sp(dest), p, D]
    rows = B * sum(heads)
    received = _all_to_all(packed.permute(2, 0, 1, 3, 4).reshape(sp * rows, p, D), [rows] * sp, [rows] * sp, group)
    pieces = received.view(sp, B, sum(heads), p, D)  # [sp(src: its heads), B, Σh, p, D]
    out, start = [], 0
    for h in heads:
        out.append(pieces[:, :, start:start + h].permute(1, 0, 2, 3, 4).reshape(B, sp * h, p, D))
        start += h
    return out


def _chunk_positions(piece: tuple[int, int], shard: int, sp: int, device: torch.device) -> torch.Tensor:
    """``[sp·p]`` global positions of the global chunk made of every rank's ``piece`` of its shard, rank-major."""
    local = torch.arange(piece[0], piece[1], device=device)
    return torch.cat([r * shard + local for r in range(sp)])


def _chunk_blocks(pieces: list[tuple[int, int]], i: int, shard: int, sp: int, window: Optional[int],
                  documents: Optional[torch.Tensor], device: torch.device
                  ) -> Iterator[tuple[int, slice, slice, bool, Optional[torch.Tensor]]]:
    """The parts of key chunk ``j`` that the queries of chunk ``i`` attend to, as ``(j, query slice, key slice,
    causal, mask)``. A global chunk is ``sp`` runs (one per rank's piece, rank-major) spread over the sequence, so a
    query run ``r`` sees, in every key chunk, the runs of the ranks before it whole, and its own rank's run whole
    (an earlier chunk), causally (its own chunk) or not at all (a later chunk): without a window or documents at most
    two kernel calls per query run and key chunk, no mask. With a window or packed documents: each (query run, key
    run) pair with its ``[p, p]`` mask on global positions (``[B, 1, p, p]`` with ``documents [B, S]``; True =
    attend; ``None``: every pair), empty pairs skipped."""
    qa, qb = pieces[i]
    p = qb - qa
    for j, (ka, kb) in enumerate(pieces):
        pk = kb - ka
        for r in range(sp):
            qs = slice(r * p, (r + 1) * p)
            if window is None and documents is None:
                whole = r * pk + (pk if j < i else 0)  # the runs this query run sees whole
                if whole:
                    yield j, qs, slice(0, whole), False, None
                if j == i:
                    yield j, qs, slice(r * pk, (r + 1) * pk), True, None
                continue
            where = torch.device("cpu") if device.type == "meta" else device  # the planner's trace: real values
            q_pos = r * shard + torch.arange(qa, qb, device=where)
            for r_key in range(r + 1):
                k_pos = r_key * shard + torch.arange(ka, kb, device=where)
                mask = causal_window_mask(q_pos, k_pos, window)  # [p, pk]
                if documents is not None:
                    mask = mask & (documents[:, q_pos, None] == documents[:, None, k_pos])[:, None]
                if not mask.any():
                    continue
                yield j, qs, slice(r_key * pk, (r_key + 1) * pk), False, (None if mask.all() else mask.to(device))


class _ChunkedUlysses(torch.autograd.Function):
    """Ulysses attention with the exchange per chunk (DeepSpeed FPDT's layout, on the strategy's contiguous shards):
    this rank's shard is cut into ``n`` pieces; piece ``i`` of every rank, exchanged alone, is global chunk ``i``
    (``sp`` runs of positions spread over the sequence, rank-major) for this rank's heads. Each query chunk attends
    to the key chunks before it (block masks on global positions), its output goes back to the sequence shards at
    once, and the chunks backward needs wait in a :class:`ChunkStore`: no rank ever holds the whole sequence of its
    heads. Backward exchanges the output's gradient chunk by chunk, accumulates each key chunk's gradients, and
    sends every gradient back to the sequence shards.

    Shapes: ``q [B, Hq, s, D]``, ``k/v [B, Hkv, s, D]`` (this rank's shard, every head; ``sp`` divides ``Hq`` and
    ``Hkv``), output ``[B, Hq, s, D]``."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,  # type: ignore[override]
                pieces_count: int, window: Optional[int], scale: float,
                documents: Optional[torch.Tensor], keep: bool) -> torch.Tensor:
        from lightning_ulysses.parallel.layout import group_size

        sp = group_size(group)
        B, Hq, s, D = q.shape
        groups = Hq // k.shape[1]
        piece = -(-s // pieces_count)
        pieces = _bounds(s, piece)
        probe = q.new_empty((1, 1, 1, D))
        kernel = block_kernel(probe)
        kernel_dtype = q.dtype if kernel in ("cpu_flash", "cuda_efficient") else (
            torch.float64 if q.dtype == torch.float64 else torch.float32)
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        store = ChunkStore(q.device)
        out = torch.empty_like(q)  # [B, Hq, s, D]
        saved: dict[str, list] = {"q": [], "k": [], "v": [], "out": [], "lse": []}
        queries = []
        for a, b in pieces:  # every chunk exchanged once; its keys and values wait in the store for every query chunk
            q_i, k_i, v_i = _to_head_shards([q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]], group)  # [B, h, c, D]
            queries.append(store.put(q_i))  # in the input's dtype (half the host bytes of a float32 copy in 16 bits)
            saved["k"].append(store.put(k_i))
            saved["v"].append(store.put(v_i))
        for i, (a, b) in enumerate(pieces):
            q_i = store.ready(store.fetch(queries[i])).to(kernel_dtype)  # [B, h, c, D]
            acc = torch.zeros((*q_i.shape[:3], v.shape[-1]), dtype=acc_dtype, device=q.device)
            acc_lse = torch.full(q_i.shape[:3], float("-inf"), dtype=acc_dtype, device=q.device)
            for j, blocks, k_j, v_j in _key_chunks(store, saved, _chunk_blocks(pieces, i, s, sp, window, documents,
                                                                               q.device)):
                k_j, v_j = _expand_heads(k_j, groups, kernel_dtype), _expand_heads(v_j, groups, kernel_dtype)
                for qs, ks, causal, mask in blocks:
                    out_b, lse_b = _block_forward(q_i[:, :, qs], k_j[:, :, ks], v_j[:, :, ks], causal, mask, scale,
                                                  kernel)
                    _merge(acc[:, :, qs], acc_lse[:, :, qs], out_b, lse_b.to(acc_dtype))
            out_i = acc.to(q.dtype)  # [B, h, c, D]: every query sees at least itself; backward reads it as returned
            out[:, :, a:b] = _to_sequence_shards([out_i], group)[0]  # [B, Hq, p, D]
            if not keep:  # no backward will run (a forward without a graph): nothing more to store
                queries[i] = None
                continue
            saved["q"].append(queries[i])
            saved["out"].append(store.put(out_i))
            saved["lse"].append(store.put(acc_lse.to(torch.float32) if kernel_dtype != torch.float64 else acc_lse))
        ctx.group, ctx.store, ctx.saved, ctx.pieces, ctx.documents = group, store, saved, pieces, documents
        ctx.meta = (window, scale, kernel, kernel_dtype, acc_dtype, groups, q.dtype, k.dtype, v.dtype, s, sp)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        group, store, saved, pieces = ctx.group, ctx.store, ctx.saved, ctx.pieces
        window, scale, kernel, kernel_dtype, acc_dtype, groups, q_dtype, k_dtype, v_dtype, s, sp = ctx.meta
        B, Hq, _, D = grad_out.shape
        device = grad_out.device
        dq = torch.empty((B, Hq, s, D), dtype=q_dtype, device=device)
        # each key chunk's gradients, [B, hkv, c, D] in the accumulation dtype, wait in the store between the query
        # chunks that add to them (no rank holds them for the whole sequence of its heads)
        saved["dk"], saved["dv"] = [None] * len(pieces), [None] * len(pieces)
        for i, (a, b) in enumerate(pieces):
            dout_i = _to_head_shards([grad_out[:, :, a:b]], group)[0].to(kernel_dtype).contiguous()  # [B, h, c, D]
            q_i, out_i = (store.ready(store.fetch(saved[name][i])).to(kernel_dtype) for name in ("q", "out"))
            lse_i = store.ready(store.fetch(saved["lse"][i]))
            dq_i = torch.zeros(q_i.shape, dtype=acc_dtype, device=device)
            blocks_of = _chunk_blocks(pieces, i, s, sp, window, ctx.documents, device)
            for j, blocks, k_j, v_j, dk_j, dv_j in _key_chunks(store, saved, blocks_of, gradients=acc_dtype):
                kx, vx = _expand_heads(k_j, groups, kernel_dtype), _expand_heads(v_j, groups, kernel_dtype)
                hkv = dk_j.shape[1]
                for qs, ks, causal, mask in blocks:
                    width = ks.stop - ks.start
                    dq_b, dk_b, dv_b = _block_backward(dout_i[:, :, qs], q_i[:, :, qs], kx[:, :, ks], vx[:, :, ks],
                                                       out_i[:, :, qs], lse_i[:, :, qs], causal, mask, scale, kernel)
                    dq_i[:, :, qs] += dq_b
                    dk_j[:, :, ks] += dk_b.view(B, hkv, groups, width, -1).sum(2)
                    dv_j[:, :, ks] += dv_b.view(B, hkv, groups, width, -1).sum(2)
                for name, grad in (("dk", dk_j), ("dv", dv_j)):
                    if saved[name][j] is not None:
                        store.release(saved[name][j])
                    saved[name][j] = store.put(grad)
            dq[:, :, a:b] = _to_sequence_shards([dq_i.to(q_dtype)], group)[0]
        dk = dv = None
        incoming = store.fetch(saved["dk"][0]), store.fetch(saved["dv"][0])
        for j, (a, b) in enumerate(pieces):  # every key chunk's gradients back to the sequence shards
            dk_j, dv_j = store.ready(incoming[0]), store.ready(incoming[1])  # [B, hkv, c, D]
            if j + 1 < len(pieces):  # the next chunk's gradients travel while this one is exchanged
                incoming = store.fetch(saved["dk"][j + 1]), store.fetch(saved["dv"][j + 1])
            dk_s, dv_s = _to_sequence_shards([dk_j.to(k_dtype), dv_j.to(v_dtype)], group)  # [B, Hkv, p, D]
            if dk is None:
                dk = dk_s.new_empty((B, dk_s.shape[1], s, dk_s.shape[-1]))
                dv = dv_s.new_empty((B, dv_s.shape[1], s, dv_s.shape[-1]))
            dk[:, :, a:b], dv[:, :, a:b] = dk_s, dv_s
        ctx.saved = None
        return dq, dk, dv, None, None, None, None, None, None


def _backward_follows(*tensors: torch.Tensor) -> bool:
    """Whether a backward pass will need what the forward stores: not in a forward without a graph (evaluation, or
    the first forward of a layer that :mod:`lightning_ulysses.offload.layer_checkpoint` runs again in backward)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _key_chunks(store: ChunkStore, saved: dict[str, list], blocks: Iterator[tuple], gradients: Optional[torch.dtype]
                = None) -> Iterator[tuple]:
    """The blocks of :func:`_chunk_blocks` grouped by key chunk, each key chunk's keys and values fetched from the
    store one chunk ahead (the next chunk travels while this one is computed): ``(j, [(query slice, key slice, causal,
    mask), ...], k_j, v_j)``, and with ``gradients`` (backward) also ``dk_j, dv_j``: the chunk's accumulated
    gradients so far (from the store, or zeros of that dtype on first use), to be stored again by the caller."""
    grouped: dict[int, list] = {}
    for j, qs, ks, causal, mask in blocks:
        grouped.setdefault(j, []).append((qs, ks, causal, mask))
    order = list(grouped)

    def fetch(j: int) -> tuple:
        names = ("k", "v") + (("dk", "dv") if gradients is not None else ())
        return tuple(None if saved[name][j] is None else store.fetch(saved[name][j]) for name in names)

    incoming = fetch(order[0]) if order else ()
    for n, j in enumerate(order):
        arrived = [None if f is None else store.ready(f) for f in incoming]
        if n + 1 < len(order):
            incoming = fetch(order[n + 1])
        k_j, v_j = arrived[0], arrived[1]  # [B, hkv, c, D]
        if gradients is None:
            yield j, grouped[j], k_j, v_j
            continue
        dk_j = arrived[2] if arrived[2] is not None else torch.zeros(k_j.shape, dtype=gradients, device=k_j.device)
        dv_j = arrived[3] if arrived[3] is not None else torch.zeros(v_j.shape, dtype=gradients, device=v_j.device)
        yield j, grouped[j], k_j, v_j, dk_j, dv_j


def chunked_ulysses_attention(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                              chunk: int, window: Optional[int], kwargs: dict[str, Any],
                              documents: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Ulysses attention with the exchange per chunk (:class:`_ChunkedUlysses`): ``q [B, Hq, s, D]``, ``k/v [B, Hkv,
    s, D]`` (this rank's contiguous shard of ``S = sp·s`` positions, every head; ``sp`` divides ``Hq``, and divides
    ``Hkv`` or is a multiple of it)
    -> ``[B, s, Hq, D]``. ``chunk``: positions per global chunk (each rank's piece: ``chunk / sp``);
    ``documents``: ``[B, S]`` packed-document index of every global position."""
    from lightning_ulysses.parallel.exchange import replicate_kv_heads
    from lightning_ulysses.parallel.layout import group_size

    scale = _checked_scale(module, q, kwargs)
    sp = group_size(group)
    k, v = replicate_kv_heads(k, sp), replicate_kv_heads(v, sp)  # fewer KV heads than ranks: one per rank
    pieces = max(1, -(-q.shape[2] * sp // chunk))
    out = _ChunkedUlysses.apply(q, k, v, group, pieces, window, scale, documents,
                                _backward_follows(q, k, v))  # [B, Hq, s, D]
    return out.transpose(1, 2)  # [B, s, Hq, D]
