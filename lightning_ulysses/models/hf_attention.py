"""The Ulysses attention functions for Hugging Face models: ``ulysses_<impl>`` entries of transformers'
``AttentionInterface`` that exchange sequence shards for head shards, run the model's own attention implementation
(``sdpa``, ``flash_attention_2/3``, ``flex_attention``) over the whole sequence (causal, sliding windows on global
positions, packed documents kept apart, ring attention across ring groups), and exchange back.

This module replaces nothing: :func:`register_attention_functions` *adds* the functions to transformers' registry
under their own names (``ulysses_sdpa``, ...), next to the stock ones, and :mod:`lightning_ulysses.models.hf` points a
prepared model's ``config._attn_implementation`` at them (and back on restore); a model the strategy has not
prepared never reaches them. Each call finds the step's context (SP group, shard layout) on the attention module
itself. Attention modules that call torch's SDPA directly instead of going through the registry are handled in
:mod:`lightning_ulysses.models.hf`, not here. The only state kept here is a small cache of flex-attention block masks.

A call whose image tokens attend to each other both ways (Gemma 3 in training) carries its blocks in the keyword
:data:`IMAGE_BLOCKS_KWARG` (an :class:`~lightning_ulysses.parallel.image_blocks.ImageBlocks`, set by the call's
completion, :mod:`lightning_ulysses.families.vision.gemma3`); transformers hands a model call's extra keywords
down to every attention call, so the blocks travel with the call (also into an activation checkpoint's recompute).
Only such calls take the block path (:func:`~lightning_ulysses.parallel.image_blocks.attend_image_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_ulysses import _compat
from lightning_ulysses._compat import ATTENTION_PREFIX
from lightning_ulysses.context import ShardInfo
from lightning_ulysses.parallel.exchange import (head_counts, head_to_sequence_shards, is_even_split,
                                                sequence_to_head_shards)
from lightning_ulysses.parallel.layout import group_rank, group_size
from lightning_ulysses.parallel.sinks import sink_attention
from lightning_ulysses.parallel.image_blocks import (IMAGE_BLOCKS_KWARG, ImageBlocks, attend_image_blocks,
                                                 refuse_unsupported_image_blocks)
from lightning_ulysses.parallel.offload_attention import chunked_ulysses_attention, offloaded_attention
from lightning_ulysses.parallel.ring import causal_window_mask, document_ids, ring_attention
from lightning_ulysses.patches import on_instance
from lightning_ulysses.training.step_context import StepContext

SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


CONTEXT_ATTRIBUTE = "_ulysses_step_context"



# Keyword arguments that describe the *local* shard's positions; the attention over the full sequence must not see them.
_LOCAL_POSITION_KWARGS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class _LocalHeadsView:
    """The attention module as the inner attention function must see it after the exchange: same attributes, but
    ``num_key_value_groups`` counts the heads this rank holds (it differs when KV heads were replicated)."""

    def __init__(self, module: nn.Module, num_key_value_groups: int) -> None:
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def attention_implementation(model: nn.Module) -> str:
    """The model's attention implementation without the Ulysses prefix (``sdpa``, ``flash_attention_2``, ...)."""
    return _compat.inner_attention_implementation(model.config)


def _packed(context: StepContext) -> bool:
    """Whether the step's rows pack several samples."""
    return context.shard_info is not None and context.shard_info.packed


def keeps_documents_apart(impl: str, sdpa_per_document: bool) -> bool:
    """Whether Ulysses attention with ``impl`` can keep packed documents from attending to each other."""
    return impl != "sdpa" or sdpa_per_document

_block_masks: dict[Any, Any] = {}
# Flex block masks are cached by (length, device, documents, window): building one evaluates the mask over every
# block, so every layer of a step reuses it (window and full-attention layers alternate: two keys per batch shape).
# When the cache holds more than this many it is emptied: lengths and packed documents' boundaries change from batch
# to batch, so old masks would only pile up.
_BLOCK_MASK_CACHE_SIZE = 4


def _flex_block_mask(seq_len: int, device: torch.device, cu_seqlens: Optional[torch.Tensor],
                     window: Optional[int] = None) -> Any:
    """Causal mask over ``seq_len`` positions; with ``cu_seqlens``, also block attention across documents; with
    ``window``, only the last ``window`` positions (the query's own included), as transformers' masks do."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (seq_len, str(device), None if cu_seqlens is None else tuple(cu_seqlens.tolist()), window)
    if key not in _block_masks:
        if len(_block_masks) > _BLOCK_MASK_CACHE_SIZE:
            _block_masks.clear()
        if cu_seqlens is None:
            document = torch.zeros(seq_len, dtype=torch.long, device=device)
        else:
            positions = torch.arange(seq_len, device=device)
            document = torch.searchsorted(cu_seqlens.to(device)[1:], positions, right=True)  # [L]
        span = window if window is not None else seq_len + 1

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (kv_idx > q_idx - span) & (document[q_idx] == document[kv_idx])

        _block_masks[key] = create_block_mask(mask_mod, None, None, seq_len, seq_len, device=device)
    return _block_masks[key]


def sliding_window_of(kwargs: dict[str, Any]) -> Optional[int]:
    """The layer's sliding window (``sliding_window`` keyword of transformers' attention call), ``None`` if none."""
    window = kwargs.get("sliding_window")
    return int(window) if window else None


def _sdpa_causal(inner: Callable, module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 window: Optional[int], kwargs: dict[str, Any]) -> torch.Tensor:
    """SDPA over one sequence, causal (or bidirectional for modules with ``is_causal = False``, encoders),
    ``q/k/v [B, h, L, D] -> [B, L, hq, D]``; with a ``window`` shorter than ``L`` an exact banded computation: query
    blocks of ``window`` positions, each against the keys it can see, with the window mask (causal: key > query -
    window; bidirectional: |key - query| < window, transformers' bidirectional sliding window). Memory grows with
    ``L × window``, not ``L²``."""
    L = q.shape[2]
    if window is None or window >= L:
        return inner(module, q, k, v, None, **kwargs)[0]
    causal = bool(getattr(module, "is_causal", True))
    pieces = []
    for start in range(0, L, window):
        end = min(start + window, L)
        first_key = max(0, start - window + 1)
        last_key = end if causal else min(L, end + window - 1)
        q_pos = torch.arange(start, end, device=q.device)
        k_pos = torch.arange(first_key, last_key, device=q.device)
        if causal:
            mask = causal_window_mask(q_pos, k_pos, window)  # [lq, lk], True = attend
        else:
            mask = (k_pos[None, :] - q_pos[:, None]).abs() < window
        pieces.append(inner(module, q[:, :, start:end], k[:, :, first_key:last_key], v[:, :, first_key:last_key],
                            mask[None, None], **kwargs)[0])  # [B, lq, hq, D]
    return torch.cat(pieces, dim=1)


def _flatten_rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, h, S, D] -> [1, h, B*S, D]``: the packed rows as one sequence, so documents are segments of it."""
    B, h, S, D = x.shape
    return x.transpose(0, 1).reshape(1, h, B * S, D)


def _attend_documents(inner_name: str, inner: Callable, module: Any, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, shard: ShardInfo, kwargs: dict[str, Any],
                      window: Optional[int] = None) -> torch.Tensor:
    """Causal attention inside each packed document only (and inside the layer's sliding ``window``).
    ``q/k/v [B, h, S, D]`` -> ``[B, S, hq, D]``."""
    B, hq, S, D = q.shape
    cu_seqlens = shard.cu_seqlens.to(device=q.device, dtype=torch.int32)  # offsets in the flattened [B*S]
    if inner_name.startswith("flash_attention"):
        # Hugging Face's varlen path flattens the batch itself and reads the offsets from these kwargs.
        kwargs.update(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                      max_length_q=shard.max_seqlen, max_length_k=shard.max_seqlen)
        out, _ = inner(module, q, k, v, None, **kwargs)  # [B, S, hq, D]
        return out.reshape(B, S, hq, -1)
    qf, kf, vf = _flatten_rows(q), _flatten_rows(k), _flatten_rows(v)  # [1, h, B*S, D]
    if inner_name == "flex_attention":
        mask = _flex_block_mask(B * S, q.device, cu_seqlens, window)
        out, _ = inner(module, qf, kf, vf, mask, **kwargs)  # [1, B*S, hq, D]
    else:  # sdpa: one exact causal call per document, no [S, S] mask
        bounds = cu_seqlens.tolist()
        pieces = [_sdpa_causal(inner, module, qf[:, :, a:b], kf[:, :, a:b], vf[:, :, a:b], window, kwargs)
                  for a, b in zip(bounds[:-1], bounds[1:])]  # each [1, L_doc, hq, D]
        out = torch.cat(pieces, dim=1)  # [1, B*S, hq, D]
    return out.reshape(B, S, hq, -1)


def chunk_size_of(module: nn.Module) -> Optional[int]:
    """The chunk of a chunked-attention layer (Llama 4's ``attention_chunk_size`` on the layers whose
    ``layer_types`` entry is ``"chunked_attention"``), ``None`` for other layers."""
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    kinds = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if not chunk or kinds is None or index is None or index >= len(kinds) or kinds[index] != "chunked_attention":
        return None
    return int(chunk)


def _attend_chunks(inner_name: str, inner: Callable, module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   chunk: int, kwargs: dict[str, Any]) -> torch.Tensor:
    """Chunked local attention over the whole sequence: causal attention inside each chunk of ``chunk`` positions,
    chunks starting at multiples of ``chunk`` of the whole row (as one device's chunked mask has them), none across
    chunks. ``q/k/v [B, h, S, D] -> [B, S, hq, D]``."""
    S = q.shape[2]
    pieces = []
    for start in range(0, S, chunk):
        end = min(start + chunk, S)
        qc, kc, vc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        if inner_name == "flex_attention":
            out, _ = inner(module, qc, kc, vc, _flex_block_mask(end - start, q.device, None, None), **kwargs)
        else:
            out, _ = inner(module, qc, kc, vc, None, **kwargs)
        pieces.append(out)  # [B, l, hq, D]
    return torch.cat(pieces, dim=1)


def global_query_temperature(module: nn.Module, query: torch.Tensor, shard: Optional[ShardInfo]) -> torch.Tensor:
    """Llama 4's attention-temperature tuning on its NoPE layers scales each query by a function of its position,
    which transformers takes from ``torch.arange`` of the call's length: on a shard, positions ``0..s-1``. The
    scale of the whole row's positions replaces it here (``query [B, H, s, D]``, the shard's positions from the step's
    facts): the query the layer would have on one device."""
    if shard is None or shard.global_index is None or not getattr(module, "attn_temperature_tuning", False) or \
            getattr(module, "use_rope", True):
        return query
    s = query.shape[2]

    def scale(positions: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((positions.double() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    local = torch.arange(s, device=query.device)
    factor = scale(shard.global_index.to(query.device)[:s]) / scale(local)  # [s]
    return query * factor.to(query.dtype).view(1, 1, s, 1)


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention call asks of the whole sequence, declared from the module, the call's keywords and the
    step's facts before any exchange or kernel runs (every refusal is raised while declaring it).

    Attributes:
        kernel: the model's attention implementation (``sdpa``, ``flash_attention_2``, ``flex_attention``, ...).
        causal: the layer attends causally (``False``: an encoder).
        window: the layer's sliding window, ``None`` if none.
        chunk: the layer's attention chunk (chunked local attention), ``None`` if none.
        documents: the step's shard facts when its rows pack several documents, else ``None``.
        image_blocks: the call's bidirectional image blocks, else ``None``.
        sinks: per-head sink logits ``[Hq]`` (every head's; each rank takes its own), else ``None``.
        ring: the SP group is several ring groups (hybrid Ulysses × ring).
    """

    kernel: str
    causal: bool = True
    window: Optional[int] = None
    chunk: Optional[int] = None
    documents: Optional[ShardInfo] = None
    image_blocks: Optional[ImageBlocks] = None
    sinks: Optional[torch.Tensor] = None
    ring: bool = False
    offload_chunk: Optional[int] = None  # offload_attention's positions per chunk

    @classmethod
    def declare(cls, module: nn.Module, kernel: str, query: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, kwargs: dict[str, Any], context: StepContext) -> "AttentionSpec":
        """The spec of one call of ``module`` (``query [B, Hq, s, D]``, ``value [B, Hkv, s, Dv]``); takes the
        strategy's own keywords out of ``kwargs`` and refuses, before compute, what the exchange cannot make exact."""
        for name in _LOCAL_POSITION_KWARGS:
            kwargs.pop(name, None)
        blocks: Optional[ImageBlocks] = kwargs.pop(IMAGE_BLOCKS_KWARG, None)
        sinks = kwargs.pop("s_aux", None)  # per-head sink logits [Hq] (GPT-OSS): each rank takes its heads' below
        if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (query.shape[1],)):
            kwargs["s_aux"] = sinks  # not one logit per query head: refused below as an unsharded tensor
            sinks = None
        _refuse_unshardable_inputs(module, attention_mask, kwargs)
        causal = bool(getattr(module, "is_causal", True))
        if blocks:  # refused before the forward already (the call's completion); kept here for any other caller
            refuse_unsupported_image_blocks(type(module).__name__, kernel, context.ring_size, _packed(context),
                                            causal)
        chunk = chunk_size_of(module)
        if chunk is not None:
            _refuse_unsupported_chunks(module, context, chunk, bool(blocks))
        if sinks is not None:
            _refuse_unsupported_sinks(module, context, chunk, bool(blocks))
        window = sliding_window_of(kwargs)
        if not kernel.startswith("flash_attention"):  # flash applies the window itself; sdpa and flex get it here
            kwargs.pop("sliding_window", None)
        if not causal:
            _refuse_unsupported_bidirectional(module, kernel, context, query.device)
        ring = context.ring_size > 1
        if ring and sinks is None and value.shape[-1] != query.shape[-1]:
            raise ValueError(ring_head_sizes_error(type(module).__name__, query.shape[-1], value.shape[-1]))
        offload_chunk = context.attention_chunk
        if offload_chunk is not None:
            _refuse_unsupported_offload(module, causal, chunk, sinks is not None, bool(blocks), query, value)
        shard = context.shard_info
        documents = shard if shard is not None and shard.packed else None
        return cls(kernel, causal, window, chunk, documents, blocks or None, sinks, ring, offload_chunk)


# Ways to attend over the whole sequence (``q [B, hq, S, D]``, ``k, v [B, hkv, S, D]`` after the exchange; each
# returns ``[B, S, hq, D]``, the ring ``[B, S/R, hq, D]``), each with the rule that picks it: the first that applies
# runs. One table instead of branches: a new kind of attention is a new row.
def _with_sinks(spec: AttentionSpec, inner: Callable, view: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kwargs: dict[str, Any], context: StepContext) -> torch.Tensor:
    """Attention with per-head sinks; with packed documents, one call per document (the sink is a logit of every
    query, whatever its document: each document attends to itself and the sink, as one device's packed mask has it).
    ``q/k/v [B, h, S, D]`` -> ``[B, S, hq, Dv]``."""
    local = _local_heads(spec.sinks, spec.sinks.shape[0], context.ulysses_group)  # [hq]: this rank's heads' sinks
    scale = kwargs.get("scaling") or q.shape[-1] ** -0.5
    if spec.documents is None:
        return sink_attention(q, k, v, local, spec.window, scale)
    B, hq, S, _ = q.shape
    bounds = spec.documents.cu_seqlens.tolist()  # offsets in the flattened [B*S] (a host tensor)
    qf, kf, vf = _flatten_rows(q), _flatten_rows(k), _flatten_rows(v)  # [1, h, B*S, D]
    pieces = [sink_attention(qf[:, :, a:b], kf[:, :, a:b], vf[:, :, a:b], local, spec.window, scale)
              for a, b in zip(bounds[:-1], bounds[1:])]  # each [1, L_doc, hq, Dv]
    return torch.cat(pieces, dim=1).reshape(B, S, hq, -1)


def _over_the_ring(spec: AttentionSpec, inner: Callable, view: Any, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, kwargs: dict[str, Any], context: StepContext) -> torch.Tensor:
    documents = None  # [B, S]: the document of every global position
    if spec.documents is not None:
        documents = document_ids(spec.documents.cu_seqlens, q.shape[0], spec.documents.padded_len, q.device)
    return ring_attention(view, q, k, v, context.ring_group, spec.window, kwargs, documents)


def _offloaded(spec: AttentionSpec, inner: Callable, view: Any, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, kwargs: dict[str, Any], context: StepContext) -> torch.Tensor:
    documents = None  # [B, S]: the document of every position
    if spec.documents is not None:
        documents = document_ids(spec.documents.cu_seqlens, q.shape[0], spec.documents.padded_len, q.device)
    return offloaded_attention(view, q, k, v, spec.offload_chunk, spec.window, kwargs, documents)


def _exchanges_per_chunk(spec: AttentionSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         group: Any) -> bool:
    """Whether ``offload_attention`` exchanges chunk by chunk (heads split evenly over more than one rank), rather
    than exchanging the whole sequence and chunking the attention after it (uneven head splits, one rank)."""
    sp = group_size(group)
    return (spec.offload_chunk is not None and sp > 1 and not spec.ring
            and is_even_split(query.shape[1], key.shape[1], sp) and value.shape[-1] == query.shape[-1])


def _offloaded_per_chunk(spec: AttentionSpec, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, group: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """``query [B, Hq, s, D]``, ``key/value [B, Hkv, s, D]`` (this rank's shard) -> ``[B, s, Hq, D]``."""
    documents = None  # [B, S]: the document of every global position
    if spec.documents is not None:
        documents = document_ids(spec.documents.cu_seqlens, query.shape[0], spec.documents.padded_len, query.device)
    return chunked_ulysses_attention(module, query, key, value, group, spec.offload_chunk, spec.window, kwargs,
                                     documents).contiguous()


def _in_chunks(spec: AttentionSpec, inner: Callable, view: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kwargs: dict[str, Any], context: StepContext) -> torch.Tensor:
    return _attend_chunks(spec.kernel, inner, view, q, k, v, spec.chunk, kwargs)


def _per_document(spec: AttentionSpec, inner: Callable, view: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kwargs: dict[str, Any], context: StepContext) -> torch.Tensor:
    if not keeps_documents_apart(spec.kernel, context.sdpa_per_document):
        raise ValueError(packed_documents_error(spec.kernel))
    return _attend_documents(spec.kernel, inner, view, q, k, v, spec.documents, kwargs, spec.window)


def _flex(spec: AttentionSpec, inner: Callable, view: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          kwargs: dict[str, Any], context: StepContext) -> torch.Tensor:
    return inner(view, q, k, v, _flex_block_mask(q.shape[2], q.device, None, spec.window), **kwargs)[0]


def _sdpa(spec: AttentionSpec, inner: Callable, view: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          kwargs: dict[str, Any], context: StepContext) -> torch.Tensor:
    return _sdpa_causal(inner, view, q, k, v, spec.window, kwargs)


def _kernel_itself(spec: AttentionSpec, inner: Callable, view: Any, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, kwargs: dict[str, Any], context: StepContext) -> torch.Tensor:
    return inner(view, q, k, v, None, **kwargs)[0]  # flash: causal and its window over the whole sequence


ATTENTION_PATHS: tuple[tuple[str, Callable[[AttentionSpec, int], bool], Callable[..., torch.Tensor]], ...] = (
    ("sinks", lambda spec, S: spec.sinks is not None, _with_sinks),
    ("ring", lambda spec, S: spec.ring, _over_the_ring),
    ("offload", lambda spec, S: spec.offload_chunk is not None, _offloaded),
    ("chunks", lambda spec, S: spec.chunk is not None and spec.chunk < S, _in_chunks),
    ("documents", lambda spec, S: spec.documents is not None, _per_document),
    ("flex", lambda spec, S: spec.kernel == "flex_attention", _flex),
    ("sdpa", lambda spec, S: spec.kernel == "sdpa", _sdpa),
    ("kernel", lambda spec, S: True, _kernel_itself),
)


def attention_path(spec: AttentionSpec, seq_len: int) -> str:
    """The name of the way :data:`ATTENTION_PATHS` attends for ``spec`` over ``seq_len`` positions."""
    return next(name for name, applies, _ in ATTENTION_PATHS if applies(spec, seq_len))


def _make_ulysses_attention(inner_name: str) -> Callable[..., tuple[torch.Tensor, None]]:
    def ulysses_attention_forward(
        module: nn.Module,
        query: torch.Tensor,  # [B, Hq, s, D]
        key: torch.Tensor,  # [B, Hkv, s, D]
        value: torch.Tensor,  # [B, Hkv, s, Dv]
        attention_mask: Optional[torch.Tensor],
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        context: Optional[StepContext] = on_instance(module, CONTEXT_ATTRIBUTE)
        if context is None:
            raise RuntimeError(
                f"{type(module).__name__} runs Ulysses attention but was not prepared by UlyssesDeepSpeedStrategy"
                f" (attention implementation {_compat.attention_implementation(module.config)!r})."
            )
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        spec = AttentionSpec.declare(module, inner_name, query, value, attention_mask, kwargs, context)
        group = context.ulysses_group
        query = global_query_temperature(module, query, context.shard_info)
        if _exchanges_per_chunk(spec, query, key, value, group):  # offload_attention: FPDT's chunked exchange
            return _offloaded_per_chunk(spec, module, query, key, value, group, kwargs), None  # [B, s, Hq, D]
        q, k, v = sequence_to_head_shards(query, key, value, group)  # [B, hq, S, D], [B, hkv, S, D] ×2
        inner = ALL_ATTENTION_FUNCTIONS[inner_name]
        view = _LocalHeadsView(module, q.shape[1] // k.shape[1])
        run = next(run for _, applies, run in ATTENTION_PATHS if applies(spec, q.shape[2]))
        out = run(spec, inner, view, q, k, v, kwargs, context)  # [B, S, hq, D] (ring: [B, S/R, hq, D])
        if spec.image_blocks and spec.sinks is None:  # the image blocks' queries, over the keys their blocks see
            out = attend_image_blocks(_masked_attention(inner, view, kwargs), q, k, v, out, spec.image_blocks,
                                      spec.window)
        # [B, s, Hq, D], contiguous as transformers' own kernels return it (JetMoE and AFMoE `.view` it)
        return head_to_sequence_shards(out, group, query.shape[1]).contiguous(), None

    ulysses_attention_forward.__name__ = f"ulysses_{inner_name}_forward"
    return ulysses_attention_forward


def ring_head_sizes_error(name: str, qk_dim: int, v_dim: int) -> str:
    return (f"{name} has value heads of {v_dim} dims and query/key heads of {qk_dim} (an MLA-style attention):"
            " ring attention passes keys and values around the ring as blocks of one head size and does not take"
            " them. Use Ulysses alone (ring_size=1; the heads must then split over sp_size), where such heads are"
            " exact. No weight was changed.")


def _masked_attention(inner: Callable, module: Any, kwargs: dict[str, Any]) -> Callable[..., torch.Tensor]:
    """The inner attention as :func:`attend_image_blocks` calls it: ``q/k/v [B, h, L, D]`` and a ``[lq, lk]`` bool
    mask (``None``: every key) -> ``[B, lq, hq, D]``, never causal by itself."""
    not_causal = dict(kwargs, is_causal=False)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        return inner(module, q, k, v, None if mask is None else mask[None, None], **not_causal)[0]

    return attend


# Tensors some models hand their attention besides q, k, v (additive position biases, attention sinks): the exchange
# does not shard them (the batch's own keys, e.g. shift_labels, also travel in these kwargs and are ignored).
_UNSHARDED_ATTENTION_TENSORS = ("position_bias", "s_aux", "sinks", "alibi", "attn_bias", "attention_bias")


def _refuse_unshardable_inputs(module: nn.Module, attention_mask: Any, kwargs: dict[str, Any]) -> None:
    """The exchange shards q, k and v only: refuse anything else the model hands its attention that would need
    sharding too, instead of silently using it on the wrong positions or heads."""
    name = type(module).__name__
    if isinstance(attention_mask, torch.Tensor) and attention_mask.requires_grad:
        raise ValueError(
            f"{name} passes its attention a mask that carries learned values (attention_mask requires grad, e.g. a"
            " learned per-key bias): UlyssesDeepSpeedStrategy's attention runs causal attention over the full"
            " sequence and cannot shard such a mask, so those parameters would get no gradient. This architecture"
            " cannot train under sequence parallelism; use sp_size=1."
        )
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor) and key in _UNSHARDED_ATTENTION_TENSORS:
            raise ValueError(
                f"{name} passes its attention a tensor `{key}` {list(value.shape)} that UlyssesDeepSpeedStrategy's"
                " exchange does not shard (it shards query, key and value over the sequence and the heads). This"
                " architecture cannot train under sequence parallelism; use sp_size=1."
            )



def _local_heads(per_head: torch.Tensor, num_heads: int, group: Any) -> torch.Tensor:
    """The entries of ``per_head [Hq]`` for the query heads this rank holds after the exchange (the first ranks take
    one more head when the split is uneven)."""
    sp, rank = group_size(group), group_rank(group)
    counts = head_counts(num_heads, sp)
    start = sum(counts[:rank])
    return per_head[start:start + counts[rank]]


def _refuse_unsupported_offload(module: nn.Module, causal: bool, chunk: Optional[int], sinks: bool,
                                image_blocks: bool, query: torch.Tensor, value: torch.Tensor) -> None:
    """``offload_attention`` runs causal attention (windows, packed documents, GQA) over chunks with the ring's block
    kernels: what it cannot make exact is refused before compute, naming the reason."""
    name = type(module).__name__
    what = ("bidirectional attention" if not causal else "chunked (Llama 4) attention" if chunk is not None
            else "attention sinks" if sinks else "image blocks" if image_blocks
            else "value heads of another size than the query/key heads" if value.shape[-1] != query.shape[-1]
            else None)
    if what is not None:
        raise ValueError(f"offload_attention does not support {what} ({name}) yet: set offload_attention=False for"
                         " this model.")


def _refuse_unsupported_sinks(module: nn.Module, context: StepContext, chunk: Optional[int],
                              image_blocks: bool) -> None:
    name = type(module).__name__
    if context.ring_size > 1:
        raise ValueError(f"{name} has attention sinks (per-head `s_aux` logits): supported with ring_size=1 (Ulysses),"
                         " not with ring attention yet.")
    if chunk is not None or image_blocks:
        raise ValueError(f"{name} has attention sinks together with chunked attention or image blocks: not"
                         " supported.")


def _refuse_unsupported_chunks(module: nn.Module, context: StepContext, chunk: int, image_blocks: bool) -> None:
    name = type(module).__name__
    shard = context.shard_info
    if context.ring_size > 1:
        raise ValueError(f"{name} is a chunked-attention layer (attention_chunk_size={chunk}): supported with"
                         " ring_size=1 (Ulysses), not with ring attention yet.")
    if shard is not None and shard.packed and chunk < shard.padded_len:
        raise ValueError(f"{name} is a chunked-attention layer (attention_chunk_size={chunk}) and this batch packs"
                         " several documents per row: chunks within packed documents are not supported yet. Give"
                         " one document per row (padded), or rows no longer than the chunk.")
    if image_blocks:
        raise ValueError(f"{name} is a chunked-attention layer with bidirectional image blocks: not supported.")


def padded_anywhere(context: StepContext, shard: Any, device: torch.device) -> bool:
    """Whether the step's batch has padding on any rank of the SP group: this rank's shard may have none while a
    peer's has some, so the SP group agrees (one all-reduce of one integer per step, cached for the step's other
    layers) and every rank refuses together instead of one rank raising while its peers wait in a collective."""
    cached = context.batch_padding
    if cached is not None and cached[0] is shard:
        return cached[1]
    local = shard.padded_len != shard.seq_len or (
        shard.attention_mask is not None and not bool(shard.attention_mask.bool().all()))
    flag = torch.tensor([int(local)], dtype=torch.int32, device=device)
    if group_size(context.sp_group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=context.sp_group)  # [1]: padding on any SP rank?
    context.record.record_batch_padding(shard, bool(flag.item()))
    return context.batch_padding[1]


def _refuse_unsupported_bidirectional(module: nn.Module, inner_name: str, context: StepContext,
                                      device: torch.device) -> None:
    """Bidirectional attention (encoders: BERT, ModernBERT) is exact under the exchange over rows without padding;
    refuse what would let real tokens see pads or run a causal kernel."""
    name = type(module).__name__
    shard = context.shard_info
    if context.ring_size > 1 or inner_name == "flex_attention":
        raise ValueError(f"{name} attends bidirectionally (an encoder); under sequence parallelism that is supported"
                         " with ring_size=1 and attn_implementation 'sdpa' or 'flash_attention_2/3'.")
    if shard is None:
        return
    if padded_anywhere(context, shard, device):
        raise ValueError(
            f"{name} attends bidirectionally (an encoder), and this batch has padding (a padding mask with zeros, or"
            f" a row length {shard.seq_len} that the strategy pads to {shard.padded_len}, a multiple of the SP"
            " layout): real tokens would attend to the pads, which the strategy's attention over the whole sequence"
            " does not mask for encoders. Give encoders rows of equal length, a multiple of sp_size, without"
            " padding (e.g. fixed-length chunks of packed text)."
        )


def packed_documents_error(impl: str) -> str:
    return (
        f"The batch packs several documents per row (position_ids restart at 0), but attn_implementation={impl!r}"
        " would let them attend to each other. Use attn_implementation='flash_attention_2'/'flash_attention_3'"
        " (varlen) or 'flex_attention' (document mask) on CUDA, or keep 'sdpa' and pass"
        " `UlyssesDeepSpeedStrategy(..., sdpa_per_document=True)` (exact: one SDPA call per document)."
    )


def register_attention_functions() -> None:
    """Add ``ulysses_<impl>`` for every supported ``<impl>`` to transformers' attention registry (idempotent)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for inner_name in SUPPORTED_ATTENTION:
        if ATTENTION_PREFIX + inner_name not in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(ATTENTION_PREFIX + inner_name, _make_ulysses_attention(inner_name))
