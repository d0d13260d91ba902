"""What a training step allocates beyond the model's states, counted from shapes alone: the model built on the meta
device (no memory, no compute) runs one forward and backward pass over one rank's shard under
:class:`~lightning_ulysses.profiling.TensorMemoryTracker`, with attention as a flash kernel keeps it (its output and
log-sum-exp saved, no ``[S, S]`` scores). Every operation of the real model runs, so the count follows the model's
own code (norms, RoPE, MLP, logits and loss) without a formula per family.

Under sequence parallelism a rank runs its ``s = S / sp`` tokens through every layer with all heads, and attention
over all ``S`` tokens with ``heads / sp`` heads: the same bytes for q, k, v, the output and the log-sum-exp as all
heads over ``s`` tokens. On top of the traced step the exchange keeps one more copy of the attention output per layer
(the kernel's saved output and ``o_proj``'s input are then two tensors; measured, docs/performance.md) and holds
transient send/receive buffers during a layer's backward (:func:`exchange_bytes`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils._python_dispatch
import torch.utils._pytree

from lightning_ulysses.profiling.tensor_memory import TensorMemoryTracker

SHAPE_ATTENTION = "lightning_ulysses_plan_shapes"


class _FlashShapes(torch.autograd.Function):
    """A flash kernel's memory, shapes only: saves q, k, v, the output and a float32 log-sum-exp ``[B, h, S]``.

    With ``sp > 1`` it also holds what the Ulysses exchange adds around the kernel: in the forward pass the exchanged
    q, k, v beside the local ones for a moment, and one more copy of the output (exchanged back to sequence shards,
    ``o_proj``'s input, while the kernel keeps its own); in the backward pass the output's gradient exchanged to head
    shards and the kernel's q/k/v gradients beside the ones exchanged back."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp: int) -> torch.Tensor:  # type: ignore[override]
        B, h, S, _ = q.shape
        if sp > 1:
            exchanged = [torch.empty_like(t) for t in (q, k, v)]  # the all-to-all's outputs, the inputs stay alive
            del exchanged
        out = q.new_empty((B, S, h, v.shape[-1])).transpose(1, 2)  # [B, h, S, Dv] over a [B, S, h, Dv] buffer, as
        # the kernels lay it out: the caller's transpose back and reshape to [B, S, h·Dv] are views, no copy
        lse = q.new_empty((B, h, S), dtype=torch.float32)
        ctx.sp = sp
        ctx.save_for_backward(q, k, v, out, lse)
        if sp > 1:  # the output exchanged back to sequence shards is what the caller holds: a second tensor
            return q.new_empty((B, S, h, v.shape[-1])).transpose(1, 2)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        q, k, v, _, _ = ctx.saved_tensors
        if ctx.sp > 1:
            grad = torch.empty_like(grad)  # the output's gradient exchanged to head shards
        kernel_grads = [torch.empty_like(t) for t in (q, k, v)]
        if ctx.sp > 1:
            exchanged_back = [torch.empty_like(t) for t in kernel_grads]
            del kernel_grads, grad
            return (*exchanged_back, None)
        return (*kernel_grads, None)


def _shape_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], sp: int = 1, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``q [B, hq, S, D]``, ``k/v [B, hkv, S, D]`` -> ``[B, S, hq, Dv]``
    (KV heads are not repeated: flash kernels read each KV head for its query heads)."""
    return _FlashShapes.apply(query, key, value, sp).transpose(1, 2), None


class _ExchangeShapes(torch.autograd.Function):
    """The Ulysses all-to-all's memory, shapes only: ``[B, h, s, D]`` (every head of the shard) -> ``[B, h/u, s·u,
    D]`` (the ring rank's tokens for this rank's heads), new tensors, and back in the backward pass."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, u: int):  # type: ignore[override]
        ctx.shapes = [t.shape for t in (q, k, v)]
        return tuple(t.new_empty((t.shape[0], max(t.shape[1] // u, 1), t.shape[2] * u, t.shape[3]))
                     for t in (q, k, v))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        return (*(grads[0].new_empty(shape) for shape in ctx.shapes), None)


class _ExchangeBackShapes(torch.autograd.Function):
    """The all-to-all back to sequence shards, shapes only: ``[B, s·u, h/u, D]`` -> ``[B, s, h, D]``."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, u: int) -> torch.Tensor:  # type: ignore[override]
        ctx.shape = out.shape
        B, L, h, D = out.shape
        return out.new_empty((B, L // u, h * u, D))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad.new_empty(ctx.shape), None


def _ring_shape_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], sp: int = 1, ring: int = 1,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Ulysses × ring attention as the strategy runs it, on the meta device: the exchange among the ``u = sp / ring``
    Ulysses ranks (shapes), then the strategy's own ring attention (:mod:`lightning_ulysses.parallel.ring`) as ring
    rank 0 of ``ring`` runs it, its passes replaced by the receive buffers they allocate and its block kernel by the
    fused one (CPU's flash op; CUDA's memory-efficient op keeps the same tensors), then the exchange back."""
    from lightning_ulysses.parallel.ring import ring_attention

    u = sp // ring
    q, k, v = _ExchangeShapes.apply(query, key, value, u) if u > 1 else (query, key, value)  # [B, h/u, S/R, D]
    out = ring_attention(module, q, k, v, None, None, kwargs)  # [B, S/R, hq/u, D]
    if u > 1:
        out = _ExchangeBackShapes.apply(out, u)  # [B, s, Hq, D]
    return out.contiguous(), None  # the strategy's contiguous copy of the exchanged (transposed) output


def _offload_shape_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Optional[torch.Tensor], sp: int = 1, chunk: int = 1,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``offload_attention`` as the strategy runs it, on the meta device: the exchange (shapes), the strategy's own
    chunked attention (:mod:`lightning_ulysses.parallel.offload_attention`) with its chunk store as on CUDA (each
    chunk leaves the device when stored and comes back as a new tensor), the exchange back."""
    from lightning_ulysses.parallel.exchange import is_even_split
    from lightning_ulysses.parallel.offload_attention import chunked_ulysses_attention, offloaded_attention

    if sp > 1 and is_even_split(query.shape[1], key.shape[1], sp) and value.shape[-1] == query.shape[-1]:
        # the exchange per chunk, as the strategy runs it where the heads split evenly
        return chunked_ulysses_attention(module, query, key, value, None, chunk, None, kwargs).contiguous(), None
    q, k, v = _ExchangeShapes.apply(query, key, value, sp) if sp > 1 else (query, key, value)  # [B, h/sp, S, D]
    out = offloaded_attention(module, q, k, v, chunk, None, kwargs)  # [B, S, hq/sp, D]
    if sp > 1:
        out = _ExchangeBackShapes.apply(out, sp)  # [B, s, Hq, D]
    return out.contiguous(), None


class _HostChunk:
    """A stored chunk's shape; its host bytes are counted until the last reference to it goes, as a host tensor's."""

    __slots__ = ("shape", "dtype", "__weakref__")

    def __init__(self, tensor: torch.Tensor, live: list[int], host: list[int]) -> None:
        self.shape, self.dtype = tensor.shape, tensor.dtype
        nbytes = tensor.numel() * tensor.element_size()
        live[0] += nbytes
        host[0] = max(host[0], live[0])
        weakref.finalize(self, _host_freed, live, nbytes)


def _host_freed(live: list[int], nbytes: int) -> None:
    live[0] -= nbytes


class _HostStoreShapes:
    """:class:`~lightning_ulysses.parallel.offload_attention.ChunkStore` as on CUDA, shapes only: a stored chunk
    leaves the device (its host bytes counted in ``host`` while its handle lives) and comes back as a new tensor."""

    offloads = True
    host = [0]
    live = [0]

    def __init__(self, device: torch.device) -> None:
        pass

    def put(self, tensor: torch.Tensor) -> _HostChunk:
        return _HostChunk(tensor, self.live, self.host)

    def release(self, handle: _HostChunk) -> None:
        pass

    def fetch(self, handle: _HostChunk) -> torch.Tensor:
        return torch.empty(handle.shape, dtype=handle.dtype, device="meta")

    def ready(self, fetched: torch.Tensor) -> torch.Tensor:
        return fetched


@contextlib.contextmanager
def _offload_attention_on_meta(host: list[int], sp: int) -> Iterator[None]:
    """The chunked attention's store as on CUDA (``host``: the host bytes its chunks hold at most, over the layers),
    its fused block kernel, and its per-chunk all-to-alls among ``sp`` ranks as the buffers they allocate."""
    from lightning_ulysses.parallel import exchange, layout, offload_attention

    def all_to_all(x: torch.Tensor, input_splits: list[int], output_splits: list[int], group: Any) -> torch.Tensor:
        x = x.contiguous()
        return x.new_empty((sum(output_splits), *x.shape[1:]))

    store = type("_Store", (_HostStoreShapes,), {"host": host, "live": [0]})
    saved = (offload_attention.ChunkStore, offload_attention.block_kernel, exchange._all_to_all, layout.group_size,
             offload_attention._chunk_blocks, offload_attention._blocks)
    offload_attention.ChunkStore = store
    offload_attention.block_kernel = lambda q, v=None: "cpu_flash"
    exchange._all_to_all = all_to_all
    layout.group_size = lambda group=None: sp
    if SAMPLE_CHUNK_BLOCKS:
        offload_attention._chunk_blocks = _nearest_blocks(offload_attention._chunk_blocks, lambda block: block[1])
        offload_attention._blocks = _nearest_blocks(offload_attention._blocks, None)
    merge, offload_attention._merge = offload_attention._merge, _merge_shapes
    try:
        yield
    finally:
        (offload_attention.ChunkStore, offload_attention.block_kernel, exchange._all_to_all, layout.group_size,
         offload_attention._chunk_blocks, offload_attention._blocks) = saved
        offload_attention._merge = merge


def _merge_shapes(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """:func:`~lightning_ulysses.parallel.ring._merge`'s allocations in its order, without its arithmetic (on the
    meta device its seven element-wise ops go through Python decompositions: 26 ms a merge, most of a long plan)."""
    new = torch.empty_like(acc_lse)  # logaddexp
    zeros, inf = torch.empty_like(new), torch.empty(new.shape, dtype=torch.bool, device=new.device)
    safe = torch.empty_like(new)
    del zeros, inf
    keep, take = torch.empty_like(new), torch.empty_like(new)
    converted = out.to(acc.dtype)
    product = torch.empty_like(converted)
    del converted, product, new, safe, keep, take


# The chunked attention's memory is the same for every query chunk and every key chunk of full size: the chunks wait
# in the host store, each block's kernel temporaries are freed before the next block. A trace therefore runs, for each
# query chunk, the blocks of its nearest key chunks (the one before, its own, the one after: a global chunk is every
# rank's piece, so a later chunk holds earlier ranks' runs), of its last query run (the widest blocks) only: the same
# peak as every block (tests/plan/test_planner.py pins it) at ~4 kernel calls per query chunk instead of ~n·sp
# (n chunks, sp ranks).
SAMPLE_CHUNK_BLOCKS = True


def _nearest_blocks(blocks: Callable[..., Iterator[tuple]], query_run: Optional[Callable[[tuple], slice]]
                    ) -> Callable[..., Iterator[tuple]]:
    def sampled(*args: Any, **kwargs: Any) -> Iterator[tuple]:
        i = args[1]
        kept = [block for block in blocks(*args, **kwargs) if i - 1 <= block[0] <= i + 1]
        if query_run is not None and kept:
            last = max(query_run(block).start for block in kept)
            kept = [block for block in kept if query_run(block).start == last]
        return iter(kept)

    return sampled


@contextlib.contextmanager
def _ring_on_meta(ring: int) -> Iterator[None]:
    """The ring's collectives and kernel choice for a trace: ``ring`` ranks, this one rank 0, each pass a receive
    buffer per block (what :func:`~lightning_ulysses.parallel.ring._start_pass` allocates), the fused block kernel."""
    from lightning_ulysses.parallel import ring as ring_module

    names = ("group_size", "group_rank", "_start_pass", "block_kernel")
    saved = {name: getattr(ring_module, name) for name in names}
    ring_module.group_size = lambda group=None: ring
    ring_module.group_rank = lambda group=None: 0
    ring_module._start_pass = lambda tensors, group: (
        [], [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors])
    ring_module.block_kernel = lambda q, v=None: "matmul" if v is not None and v.shape[-1] != q.shape[-1] else (
        "cpu_flash")
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ring_module, name, value)


def _register(sp: int, ring: int = 1, chunk: Optional[int] = None) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    if chunk is not None:
        name = f"{SHAPE_ATTENTION}_sp{sp}_offload{chunk}"
        AttentionInterface.register(name, functools.partial(_offload_shape_attention, sp=sp, chunk=chunk))
    elif ring > 1:
        name = f"{SHAPE_ATTENTION}_sp{sp}_ring{ring}"
        AttentionInterface.register(name, functools.partial(_ring_shape_attention, sp=sp, ring=ring))
    else:
        name = f"{SHAPE_ATTENTION}_sp{sp}"
        AttentionInterface.register(name, functools.partial(_shape_attention, sp=sp))
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, flash_attention_mask)  # no 4-D mask, as flash
    return name


@contextlib.contextmanager
def _no_value_reads() -> Iterator[None]:
    """transformers looks for packed documents in the positions it made itself (``arange``: none), which reads values
    a meta tensor does not have: the answer is known, no documents."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda *args, **kwargs: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


# The strategy's tiled MLP and tiled loss allocate and free the same for every tile (the MLP's output and input
# gradient are written into whole tensors made once, the weights' gradients accumulate, a loss chunk's logits live
# for that chunk): the trace runs the first two tiles (the largest) and the last, the same peak as every tile
# (tests/plan/test_planner.py), a few traced tiles instead of thousands (a Llama-3.1-8B at 256K tokens per rank: 64
# MLP tiles per layer and 2016 loss chunks).
SAMPLE_TILES = True


def _sample(tiles: int) -> list[int]:
    return sorted({0, 1, tiles - 1}) if tiles > 3 else list(range(tiles))


class _ChunksNotRun(torch.autograd.Function):
    """The loss chunks the trace does not run, as their checkpoints leave them: their hidden states and labels saved
    (views; offloaded with the checkpoints when they are), and in backward a gradient of their size, which autograd
    holds with the other chunks' until the split of the hidden states takes them all. One node and one piece of the
    split for all of them (a Llama-3.1-8B at 256K tokens per rank has 2016 loss chunks): the same bytes as one per
    chunk, in one tensor."""

    @staticmethod
    def forward(ctx, *pieces: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(*pieces)  # hidden chunks, then their labels
        return pieces[0].new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        pieces = ctx.saved_tensors
        half = len(pieces) // 2
        return (*(torch.empty_like(h) for h in pieces[:half]), *([None] * half))


@contextlib.contextmanager
def _tiles_sampled() -> Iterator[None]:
    """The tiles sampled (above). The loss chunks not run (the middle ones) leave what their checkpoints leave
    (:class:`_ChunksNotRun`), between the chunks run in the order of the loop: the loop below is
    :func:`~lightning_ulysses.models.memory.tiled_cross_entropy_sum`'s with those chunks replaced."""
    from lightning_ulysses.models import memory

    saved = memory._tiles_run, memory.tiled_cross_entropy_sum

    def loss(hidden: torch.Tensor, lm_head: Any, shift_labels: torch.Tensor, chunks: int) -> torch.Tensor:
        total = hidden.new_zeros((), dtype=torch.float32)
        length = hidden.shape[1]
        ends = [i * (length // chunks) + min(i, length % chunks) for i in range(1, chunks)]  # where tensor_split cuts
        sampled = len(_sample(chunks)) < chunks
        if sampled:  # chunks 0 and 1, the middle ones as one piece (their bytes, one tensor each way), the last
            ends = [ends[0], ends[1], ends[-1]]
        for index, (h, y) in enumerate(zip(torch.tensor_split(hidden, ends, dim=1),
                                           torch.tensor_split(shift_labels, ends, dim=1))):
            if sampled and index == 2:
                total = total + _ChunksNotRun.apply(h, y)
                continue
            total = total + memory.checkpoint(memory._chunk_loss_sum, h, y, lm_head, use_reentrant=False)
        return total

    if SAMPLE_TILES:
        memory._tiles_run, memory.tiled_cross_entropy_sum = _sample, loss
    try:
        yield
    finally:
        memory._tiles_run, memory.tiled_cross_entropy_sum = saved


# ------------------------------------------------------------------------------------- gated delta rules, calibrated
# transformers' torch fallback of the chunked gated delta rule (hybrid models without flash-linear-attention, what a
# CPU runs) loops over 64-token chunks: traced op by op on the meta device it is most of a hybrid's plan (90 s for a
# 24-layer model at 16K tokens per rank). Its memory is linear in the chunk count (per-chunk tensors, a constant
# recurrent state), so it is traced for real at two small lengths (3 and 5 chunks), and each call of the plan runs an
# autograd function that allocates, frees and keeps what the line through those two says, in the same order, saving
# the inputs the real rule saves (tests/plan/test_planner.py checks the line against a third, longer trace).
_DELTA_RULE = "torch_chunk_gated_delta_rule"
_CALIBRATION_CHUNKS = (3, 5)  # from 3 chunks on every part is linear (at 2 the backward is not)
_delta_rule_lines: dict[tuple, tuple[float, ...]] = {}
_delta_rule_saved_inputs: dict[tuple, tuple[int, ...]] = {}
_planned_rules: set = set()


def _bytes(*tensors: Optional[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _delta_rule_memory(original: Callable[..., Any], chunks: int, like: tuple, chunk_size: int,
                       flags: dict[str, Any]) -> tuple[int, int, int]:
    """One real trace of the fallback over ``chunks`` chunks (inputs shaped ``like`` but for the length): bytes it
    keeps after forward besides its outputs, its forward's transient peak above that, and its backward's transient
    peak above the input gradients (the kept bytes alive until backward ends, as the plan's function keeps them)."""
    return _delta_rule_trace(original, chunks, like, chunk_size, flags)[0]


def _delta_rule_trace(original: Callable[..., Any], chunks: int, like: tuple, chunk_size: int,
                      flags: dict[str, Any]) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    """:func:`_delta_rule_memory`'s sizes, and which of the inputs the fallback saves for backward (saving a view of
    a larger tensor keeps that tensor alive: the plan's function saves the same ones)."""
    tokens = chunks * chunk_size
    inputs = [torch.empty((t[0], tokens, *t[2][2:]), dtype=t[1], device="meta", requires_grad=t[3]) for t in like]
    saved_storages: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved_storages.add(tensor.untyped_storage()._cdata)
        return tensor

    # the recording hooks inside the tracker's (the innermost hooks are the ones that run)
    with torch.utils._python_dispatch._disable_current_modes(), torch.enable_grad(), TensorMemoryTracker() as tracker, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, state = original(*inputs, chunk_size=chunk_size, **flags)
        forward_peak, forward_end = tracker._peak.peak_bytes, tracker._current
        kept = forward_end - _bytes(out, state)
        grad = torch.empty_like(out)
        start = tracker._current
        tracker._peak.peak_bytes = start
        saved_inputs = tuple(i for i, t in enumerate(inputs) if t.untyped_storage()._cdata in saved_storages)
        torch.autograd.backward(out, grad)
        input_grads = _bytes(*(t for t in inputs if t.requires_grad))
        backward_transient = tracker._peak.peak_bytes - start - input_grads
        del out, state, grad
    return (kept, forward_peak - forward_end, backward_transient), saved_inputs


class _CalibratedDeltaRule(torch.autograd.Function):
    """The fallback's memory, by its calibrated line (see above): ``kept`` bytes saved for backward, transients
    allocated and freed, outputs and input gradients of their real shapes."""

    @staticmethod
    def forward(ctx, sizes: tuple[int, int, int], saved_inputs: tuple[int, ...],  # type: ignore[override]
                out_like: tuple, state_like: Optional[tuple], *inputs: torch.Tensor) -> Any:
        kept, forward_transient, backward_transient = sizes
        device = inputs[0].device
        blob = torch.empty(-(-kept // 4), dtype=torch.float32, device=device)
        out = torch.empty(out_like[0], dtype=out_like[1], device=device)
        state = torch.empty(state_like[0], dtype=state_like[1], device=device) if state_like else None
        transient = torch.empty(-(-forward_transient // 4), dtype=torch.float32, device=device)
        del transient
        ctx.save_for_backward(blob, *(inputs[i] for i in saved_inputs))
        ctx.backward_transient = backward_transient
        ctx.inputs_like = [(t.shape, t.dtype) for t in inputs]
        ctx.mark_non_differentiable(*([state] if state is not None else []))
        return (out, state) if state is not None else out

    @staticmethod
    def backward(ctx, *grads: Any) -> Any:  # type: ignore[override]
        blob = ctx.saved_tensors[0]
        device = blob.device
        input_grads = [torch.empty(shape, dtype=dtype, device=device) if ctx.needs_input_grad[4 + i] else None
                       for i, (shape, dtype) in enumerate(ctx.inputs_like)]
        transient = torch.empty(-(-ctx.backward_transient // 4), dtype=torch.float32, device=device)
        del transient, blob
        return (None, None, None, None, *input_grads)


def _calibrated_delta_rule(original: Callable[..., Any]) -> Callable[..., Any]:
    def planned(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                chunk_size: int = 64, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                use_qk_l2norm_in_kernel: bool = False, **kwargs: Any) -> Any:
        inputs = (query, key, value, g, beta)
        chunks = -(-query.shape[1] // chunk_size)
        if (initial_state is not None or kwargs.get("cu_seqlens") is not None
                or chunks <= _CALIBRATION_CHUNKS[-1] or query.device.type != "meta"):
            return original(query, key, value, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            **kwargs)
        flags = {"output_final_state": output_final_state, "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel}
        like = tuple((t.shape[0], t.dtype, tuple(t.shape), t.requires_grad) for t in inputs)
        signature = (original, tuple((b, d, shape[2:], r) for b, d, shape, r in like), chunk_size,
                     tuple(sorted(flags.items())))
        if signature not in _delta_rule_lines:
            (n1, n2) = _CALIBRATION_CHUNKS
            first, saved_inputs = _delta_rule_trace(original, n1, like, chunk_size, flags)
            second, _ = _delta_rule_trace(original, n2, like, chunk_size, flags)
            _delta_rule_lines[signature] = tuple(v for a, b in zip(first, second)
                                                 for v in (a, (b - a) / (n2 - n1)))
            _delta_rule_saved_inputs[signature] = saved_inputs
        line = _delta_rule_lines[signature]
        n1 = _CALIBRATION_CHUNKS[0]
        sizes = tuple(max(0, int(round(line[2 * i] + line[2 * i + 1] * (chunks - n1)))) for i in range(3))
        B, S, _, _ = query.shape
        out_like = ((B, S, value.shape[2], value.shape[3]), query.dtype)
        state_like = (((B, value.shape[2], key.shape[3], value.shape[3]), torch.float32) if output_final_state
                      else None)
        found = _CalibratedDeltaRule.apply(sizes, _delta_rule_saved_inputs[signature], out_like, state_like, *inputs)
        return found if state_like is not None else (found, None)

    return planned


@contextlib.contextmanager
def _delta_rules_calibrated(model: torch.nn.Module) -> Iterator[None]:
    """The gated delta rule's torch fallback of ``model``'s modeling modules, by calibration (see above)."""
    import sys

    patched = []
    for name in {type(module).__module__ for module in model.modules()}:
        modeling = sys.modules.get(name)
        original = getattr(modeling, _DELTA_RULE, None)
        if original is not None and original not in _planned_rules:  # (a trace inside a trace: already planned)
            planned = _calibrated_delta_rule(original)
            _planned_rules.add(planned)
            setattr(modeling, _DELTA_RULE, planned)
            patched.append((modeling, original, planned))
    try:
        yield
    finally:
        for modeling, original, planned in patched:
            setattr(modeling, _DELTA_RULE, original)
            _planned_rules.discard(planned)


@contextlib.contextmanager
def _grouped_experts_on_meta() -> Iterator[None]:
    """transformers' fused experts (``gate_up_proj`` [E, ...]) multiply with torch's grouped matmul, whose meta kernel
    takes bf16 only; on the meta device they take transformers' fallback instead, whose meta form allocates what the
    grouped matmul does ([tokens·top_k, out] forward; the input's and the weights' gradients backward): the traced
    step of a Mixtral or a Qwen3-MoE equals the real CPU step byte for byte (``tests/plan/test_planner.py``). The
    fused path's memory does not depend on which experts the tokens pick, only on how many picks there are."""
    try:
        from transformers.integrations import moe
    except ImportError:  # a transformers without fused experts
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return
    moe._can_use_grouped_mm = lambda input, weight, offs: False if weight.device.type == "meta" else original(
        input, weight, offs)
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


class _HostJoinsMeta(torch.utils._python_dispatch.TorchDispatchMode):
    """An operation mixing meta tensors with host tensors (index tensors a model computes from real values: a vision
    tower's positions and windows from its image grid, rotary positions from token ids) runs on the meta device: the
    host tensors join it. The values stay real where the model reads them; the big tensors stay shapes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(t.is_meta for t in leaves) and any(not t.is_meta and t.dim() > 0 for t in leaves):
            def to_meta(a: Any) -> Any:
                return a.to("meta") if isinstance(a, torch.Tensor) and not a.is_meta and a.dim() > 0 else a

            args, kwargs = torch.utils._pytree.tree_map(to_meta, (args, kwargs))
        return func(*args, **kwargs)


def rank_vision_units(grids: Any, sp: int) -> list[tuple[int, int, int]]:
    """The vision units (``(1, h, w)``: an image, or one temporal patch of a video) the busiest of ``sp`` ranks
    encodes, from a row's grids ``[(t, h, w), ...]`` (the processor's ``image_grid_thw`` and ``video_grid_thw``, in
    patches): the strategy deals the units to the ranks in contiguous runs balanced by their patches."""
    units = [(1, int(h), int(w)) for t, h, w in grids for _ in range(int(t))]
    total = sum(h * w for _, h, w in units)
    ranks: list[list[tuple[int, int, int]]] = [[] for _ in range(sp)]
    done = 0
    for unit in units:
        middle = done + unit[1] * unit[2] / 2  # a unit goes to the rank whose share holds its middle
        ranks[min(int(middle * sp / max(total, 1)), sp - 1)].append(unit)
        done += unit[1] * unit[2]
    return max(ranks, key=lambda mine: sum(h * w for _, h, w in mine))


def _vision_tower_kept(model: Any, units: list[tuple[int, int, int]], attention: str) -> int:
    """The bytes a Qwen-VL-style vision tower (``model.model.visual(pixel_values, grid_thw=...)``) keeps for backward
    after encoding ``units`` (``(t, h, w)`` grids in patches), its output included: alive while the language model
    runs, until the backward pass reaches the tower last. Its attention is counted as a flash kernel keeps it
    (``attention``)."""
    from lightning_ulysses import _compat

    visual = getattr(getattr(model, "model", None), "visual", None)
    vision = model.config.vision_config
    if visual is None or not hasattr(vision, "temporal_patch_size"):
        raise ValueError(f"vision grids are planned for Qwen-VL-style vision towers (model.model.visual(pixel_values,"
                         f" grid_thw=...)), not yet for {type(model).__name__}.")
    _compat.set_attention_implementation(vision, attention)
    grid = torch.tensor(units, dtype=torch.long)  # [units, 3]: real values, the tower reads them
    channels = getattr(vision, "in_channels", getattr(vision, "in_chans", 3))
    pixels = torch.empty((int(grid.prod(-1).sum()), channels * vision.temporal_patch_size * vision.patch_size ** 2),
                         dtype=next(visual.parameters()).dtype, device="meta")
    with _HostJoinsMeta(), TensorMemoryTracker() as tracker:
        encoded = visual(pixels, grid_thw=grid)  # its graph holds what the tower saved for backward
    kept = tracker.result().end_bytes
    del encoded
    return kept


@dataclass(frozen=True)
class TracedStep:
    """One rank's traced step, in bytes: ``peak`` (the step's allocations at their peak), ``by_kind`` and
    ``by_layer`` (their composition there); ``parameters``: the model's parameter count, ``trainable`` those that
    require a gradient."""

    peak: int
    by_kind: dict[str, int]
    by_layer: dict[str, int]
    parameters: int
    trainable: int
    numels: tuple[int, ...] = ()  # every parameter's element count
    largest_layer: int = 0  # parameters of the largest block of the model's longest ModuleList (its layers)
    host: int = 0  # host bytes the offloaded checkpoints held at most
    module_numels: tuple[tuple[int, ...], ...] = ()  # each module's own parameters' element counts, in model order
    vision: int = 0  # what the vision tower keeps for backward (in ``peak``), vision-language models


@contextlib.contextmanager
def _offload_shapes(host: list[int]) -> Iterator[None]:
    """The strategy's checkpoint offload (:func:`lightning_ulysses.models.memory._offload_to_host`, and with
    ``offload_attention`` the recompute's :func:`lightning_ulysses.offload.layer_checkpoint.host_saved_tensors`) as it
    behaves on an accelerator, shapes only: a saved tensor leaves the device when saved and comes back as a new tensor
    in backward; ``host`` gets the host bytes they held at most."""
    from lightning_ulysses.models import memory
    from lightning_ulysses.offload import layer_checkpoint

    live = [0]

    def offload() -> torch.autograd.graph.saved_tensors_hooks:
        def pack(tensor: torch.Tensor) -> tuple:
            nbytes = tensor.numel() * tensor.element_size()
            live[0] += nbytes
            host[0] = max(host[0], live[0])
            return tensor.shape, tensor.dtype, nbytes

        def unpack(packed: tuple) -> torch.Tensor:
            shape, dtype, nbytes = packed
            live[0] -= nbytes
            return torch.empty(shape, dtype=dtype, device="meta")  # the copy back to the device

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def recompute_saving(device: torch.device) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(tensor: torch.Tensor) -> Any:
            if layer_checkpoint._is_parameter_data(tensor):
                return tensor
            if tensor.numel() * tensor.element_size() < layer_checkpoint.HOST_MIN_BYTES:
                return tensor if not layer_checkpoint._large_storage(tensor) else tensor.clone()
            return offload().pack_hook(tensor)

        def unpack(packed: Any) -> torch.Tensor:
            return packed if isinstance(packed, torch.Tensor) else offload().unpack_hook(packed)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    original = memory._offload_to_host, layer_checkpoint.host_saved_tensors
    memory._offload_to_host, layer_checkpoint.host_saved_tensors = offload, recompute_saving
    try:
        yield
    finally:
        memory._offload_to_host, layer_checkpoint.host_saved_tensors = original


def _gradient_hooks(model: torch.nn.Module, gradient_buffer_bytes: int, gradients_leave: bool) -> list[Any]:
    """ZeRO's part of a traced step (see :func:`trace_step`): the buffer it allocates at the first gradient and keeps,
    and each gradient leaving once complete. The hooks, to remove after the trace."""
    buffers: list[torch.Tensor] = []

    def first_gradient(param: torch.Tensor) -> None:
        if gradient_buffer_bytes and not buffers:
            buffers.append(torch.empty(-(-gradient_buffer_bytes // 4), dtype=torch.float32, device="meta"))
        if gradients_leave:
            param.grad = None

    return [p.register_post_accumulate_grad_hook(first_gradient) for p in model.parameters() if p.requires_grad]


SAMPLED_LAYERS = (2, 3)  # a model of identical decoder layers is traced with this many, then along the line


def trace_step(config: Any, tokens: int, *args: Any, **kwargs: Any) -> TracedStep:
    """:func:`trace_layers` (the same arguments) of the whole model; for a model whose decoder layers are all alike
    (:func:`uniform_layers`) and more than ``SAMPLED_LAYERS[1] + 1`` of them, the same two traces of
    ``SAMPLED_LAYERS`` layers and the line through them: every part of a step's peak (the saved activations, the
    checkpoints on the host, the gradients in flight) is the same per layer, so the step at ``L`` layers is
    ``t(2) + (L - 2) · (t(3) - t(2))``, equal to the whole trace to the byte (``tests/plan/test_planner.py``) at an
    eighth of its time for 32 layers. The parameter counts come from the whole model built on the meta device;
    ``by_layer`` is the last sampled trace's."""
    layers, model = _alike_layers(config)
    if layers is None or layers <= SAMPLED_LAYERS[1] + 1:
        return trace_layers(config, tokens, *args, **kwargs)
    first, second = (trace_layers(with_layers(config, n), tokens, *args, **kwargs) for n in SAMPLED_LAYERS)
    steps = layers - SAMPLED_LAYERS[0]

    def line(a: int, b: int) -> int:
        return a + steps * (b - a)

    kinds = set(first.by_kind) | set(second.by_kind)
    by_kind = {kind: line(first.by_kind.get(kind, 0), second.by_kind.get(kind, 0)) for kind in kinds}
    return TracedStep(line(first.peak, second.peak), by_kind, dict(second.by_layer), *_parameter_counts(model),
                      line(first.host, second.host), _module_numels(model), 0)


def _meta_model(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)


_PER_MODULE_SKIPPED = {"training", "layer_idx", "_is_hf_initialized"}


def _layer_signature(layer: torch.nn.Module) -> tuple:
    """What a decoder layer is made of: each submodule's type, its parameters' shapes and its plain settings (a
    sliding window, an attention type, a flag; not its index)."""
    found = []
    for name, module in layer.named_modules():
        settings = tuple(sorted((key, value) for key, value in vars(module).items()
                                if key not in _PER_MODULE_SKIPPED and not key.startswith("_")
                                and isinstance(value, (bool, int, float, str, type(None)))))
        shapes = tuple((key, tuple(p.shape), p.dtype, p.requires_grad)
                       for key, p in module.named_parameters(recurse=False))
        found.append((name, type(module).__name__, settings, shapes))
    return tuple(found)


def uniform_layers(config: Any) -> Optional[int]:
    """How many decoder layers a Hugging Face causal LM built from ``config`` has, where they are all alike (built on
    the meta device: every layer's modules, parameter shapes and plain settings equal, and every per-layer list of
    the config, such as ``layer_types``, one value); ``None`` otherwise (alternating windows, hybrids' mixers, dense
    layers before the experts, vision-language models, anything not built this way), which are traced whole."""
    return _alike_layers(config)[0]


def _alike_layers(config: Any) -> tuple[Optional[int], Optional[torch.nn.Module]]:
    """:func:`uniform_layers`'s count and the meta model it was read from (the plan's parameter counts)."""
    try:
        if getattr(config, "vision_config", None) is not None:
            return None, None
        count = int(getattr(config, "num_hidden_layers", 0) or 0)
        per_layer = [value for value in config.to_dict().values() if isinstance(value, (list, tuple))
                     and len(value) == count]
        if count < 1 or any(len({repr(v) for v in value}) > 1 for value in per_layer):
            return None, None
        model = _meta_model(config, torch.float32)
    except Exception:  # noqa: BLE001 - a config not built this way: traced whole
        return None, None
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    if len(lists) != 1 or len({_layer_signature(layer) for layer in lists[0]}) != 1:
        return None, model
    return count, model


def with_layers(config: Any, layers: int) -> Any:
    """``config`` with its first ``layers`` decoder layers (its per-layer lists cut alike)."""
    count = config.num_hidden_layers
    config = copy.deepcopy(config)
    for key, value in list(vars(config).items()):
        if isinstance(value, (list, tuple)) and len(value) == count:
            setattr(config, key, type(value)(value[:layers]))
    config.num_hidden_layers = layers
    return config


def trace_layers(config: Any, tokens: int, batch_size: int = 1, dtype: torch.dtype = torch.float32, sp: int = 1,
                 gradient_buffer_bytes: int = 0, gradients_leave: bool = False, tiled_mlp: Any = 0,
                 tiled_loss: Any = 0, offload_checkpoints: bool = False,
                 gradient_checkpointing: bool = False, ring: int = 1,
                 vision_units: Optional[list[tuple[int, int, int]]] = None,
                 attention_chunk: Optional[int] = None) -> TracedStep:
    """Count one forward and backward pass of a Hugging Face causal LM built from ``config`` over one rank's
    ``[batch_size, tokens]`` shard in ``dtype``, on the meta device, with the exchange of ``sp`` ranks around
    attention. ``gradient_buffer_bytes``: what the ZeRO optimizer allocates when the first gradient arrives and keeps
    to the end of the step (ZeRO 1/2: two reduce buckets); ``gradients_leave``: each parameter's gradient leaves as
    soon as it is complete (ZeRO copies it into its buckets and drops it). ``tiled_mlp``, ``tiled_loss``,
    ``offload_checkpoints``: the strategy's memory switches, applied by the strategy's own code (the offload as on an
    accelerator: checkpoints in host memory); ``gradient_checkpointing``: the model's own activation checkpointing
    (``gradient_checkpointing_enable()``); ``ring``: the strategy's ``ring_size`` (``sp`` ranks of which ``sp / ring``
    exchange heads, attention over the ring run by the strategy's own ring code); ``vision_units``: for a
    vision-language ``config`` (a Qwen-VL-style tower), the ``(t, h, w)`` grids this rank's vision tower encodes
    (:func:`rank_vision_units`; their features are among the ``tokens``); ``attention_chunk``: the strategy's
    ``offload_attention`` (positions per chunk; its chunks in host memory as on CUDA)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText


    from lightning_ulysses.models import memory

    name = _register(sp, ring, attention_chunk)
    config = copy.deepcopy(config)
    config.use_cache = False
    vision_language = getattr(config, "vision_config", None) is not None
    with torch.device("meta"):
        builder = AutoModelForImageTextToText if vision_language else AutoModelForCausalLM
        model = builder.from_config(config, attn_implementation=name, dtype=dtype)
    model.train()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    features = memory.MemoryFeatures(tiled_mlp, tiled_loss, offload_checkpoints,
                                     ulysses_offload=bool(attention_chunk))
    memory.enable(model, features, None)
    # a vision-language model computes its rotary positions from the ids' values: real ids (text only) there
    ids = torch.zeros((batch_size, tokens), dtype=torch.long, device="cpu" if vision_language else "meta")
    host = [0]
    hooks = _gradient_hooks(model, gradient_buffer_bytes, gradients_leave)
    targets = {"shift_labels": ids} if tiled_loss else {"labels": ids}
    attention_host = [0]
    vision = _vision_tower_kept(model, vision_units, _register(1)) if vision_language and vision_units else 0
    joining = _HostJoinsMeta() if vision_language else contextlib.nullcontext()
    try:
        with _no_value_reads(), _grouped_experts_on_meta(), _delta_rules_calibrated(model), \
                _offload_shapes(host), _tiles_sampled(), \
                _ring_on_meta(ring), joining, \
                _offload_attention_on_meta(attention_host, sp), TensorMemoryTracker() as tracker:
            model(input_ids=ids, **targets).loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
        memory.disable(model)  # what the switches put on transformers' modules (the rotary tiles) goes with the trace
    step = tracker.result()
    by_kind = dict(step.by_kind)
    if vision:
        by_kind["vision tower (kept for backward)"] = vision
    return TracedStep(step.peak_bytes + vision, by_kind, dict(step.by_layer), *_parameter_counts(model),
                      host[0] + attention_host[0], _module_numels(model), vision)


def _parameter_counts(model: torch.nn.Module, layers: Optional[Any] = None) -> tuple[int, int, tuple[int, ...], int]:
    """:class:`TracedStep`'s ``parameters``, ``trainable``, ``numels`` and ``largest_layer`` (over ``layers``, by
    default the model's longest ModuleList)."""
    if layers is None:
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        layers = max(lists, key=len) if lists else []
    return (sum(p.numel() for p in model.parameters()),
            sum(p.numel() for p in model.parameters() if p.requires_grad),
            tuple(p.numel() for p in model.parameters()),
            max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0))


def _module_numels(model: torch.nn.Module) -> tuple[tuple[int, ...], ...]:
    """Each module's own parameters' element counts (a tied weight once), in registration order: the order ZeRO 3
    gathers them in the forward pass (reversed in backward)."""
    seen: set[int] = set()
    found = []
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            found.append(tuple(p.numel() for p in own))
    return tuple(found)


def is_litgpt_config(config: Any) -> bool:
    """A LitGPT ``Config`` (``litgpt.config.Config``), not a Hugging Face one."""
    return any(cls.__module__ == "litgpt.config" and cls.__name__ == "Config" for cls in type(config).__mro__)


def trace_litgpt_step(config: Any, tokens: int, batch_size: int = 1, dtype: torch.dtype = torch.float32, sp: int = 1,
                      gradient_buffer_bytes: int = 0, gradients_leave: bool = False) -> TracedStep:
    """:func:`trace_step` for LitGPT's ``GPT`` built from a LitGPT ``Config`` as the strategy runs it
    (:mod:`lightning_ulysses.models.litgpt`): every block's ``scaled_dot_product_attention`` is the Ulysses exchange
    around a flash kernel (``q, k, v [B, n_head, s, hs]``, keys and values already expanded to ``n_head`` by LitGPT),
    the loss LitGPT's pretraining takes (cross-entropy over the logits, ``[B, s, padded_vocab_size]``). The RoPE
    cache (``cos``/``sin``, ``[block_size, rope_n_elem]``, a model buffer) counts with the step's allocations."""
    from litgpt.model import GPT

    with torch.device("meta"):
        model = GPT(config).to(dtype)
    model.train()
    for block in model.transformer.h:
        block.attn.scaled_dot_product_attention = (  # type: ignore[method-assign]
            lambda q, k, v, mask=None: _FlashShapes.apply(q, k, v, sp).transpose(1, 2))  # [B, s, n_head, hs]
    ids = torch.zeros((batch_size, tokens), dtype=torch.long, device="meta")
    hooks = _gradient_hooks(model, gradient_buffer_bytes, gradients_leave)
    rope_cache = sum(b.numel() * b.element_size() for b in (model.cos, model.sin))
    try:
        with TensorMemoryTracker() as tracker:
            logits = model(ids)  # [B, s, V]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
            del logits
            loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    step = tracker.result()
    by_kind = dict(step.by_kind)
    by_kind["RoPE cache (cos, sin)"] = rope_cache
    return TracedStep(step.peak_bytes + rope_cache, by_kind, dict(step.by_layer),
                      *_parameter_counts(model, model.transformer.h), 0, _module_numels(model), 0)
