"""The data path under SP: every rank of an SP group reads the same full batch, and a collate step cuts its shard.

The sampler is Lightning's ``DistributedSampler`` with ``num_replicas=dp`` and ``rank=dp_rank`` (set through the
strategy's ``distributed_sampler_kwargs``), so no collective is spent on data. :class:`SequenceShardingCollate`
wraps the user's collate function (or PyTorch's default) and turns each full batch into this rank's shard.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
from torch.utils.data import DataLoader, default_collate

from lightning_ulysses.context import IGNORE_INDEX, SHARD_INFO_KEY, ShardInfo
from lightning_ulysses.data.fingerprint import batch_fingerprint
from lightning_ulysses.data.halo import next_token_sources
from lightning_ulysses.parallel.geometry import SequenceGeometry

# Keys the collate step reads or writes; every other [B, S, ...] tensor is padded with 0 and sliced.
INPUT_IDS, LABELS, SHIFT_LABELS, POSITION_IDS, ATTENTION_MASK = (
    "input_ids",
    "labels",
    "shift_labels",
    "position_ids",
    "attention_mask",
)
_PAD_VALUES = {LABELS: IGNORE_INDEX, SHIFT_LABELS: IGNORE_INDEX}
_CONTRACT_KEYS = (LABELS, SHIFT_LABELS, POSITION_IDS, ATTENTION_MASK)
# Vision inputs of vision-language models: per image / video / patch, never per token, so never cut (a pixel tensor
# whose first two dimensions happen to equal [B, S] must not be taken for a sequence).
VISION_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "second_per_grid_ts",
               "image_sizes", "pixel_attention_mask", "video_second_per_grid", "image_sizes_videos",
               "batch_num_images")
# The full batch's token tensors a vision-language model's positions and image placement are computed from.
_MULTIMODAL_TOKEN_KEYS = (INPUT_IDS, "mm_token_type_ids", ATTENTION_MASK, POSITION_IDS)


def shard_batch(
    batch: Mapping[str, Any],
    sp_size: int,
    sp_rank: int,
    pad_token_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
    fingerprint: bool = False,
    ring_size: int = 1,
) -> dict[str, Any]:
    """Cut this SP rank's shard out of a full batch.

    The batch contract is checked first (:func:`check_batch_contract`); with ``fingerprint=True`` the full batch's
    digest is recorded for the SP-peer agreement check. With ``ring_size > 1`` (hybrid Ulysses × ring) ``S`` is
    padded to a multiple of ``2 × sp_size`` and the shard follows the load-balanced zigzag layout of
    :mod:`lightning_ulysses.parallel.ring` instead of step 5's contiguous slice.

    Steps, in order, on the full ``[B, S]`` batch:

    1. ``position_ids``: kept if present (a ``[1, S]`` row is broadcast to ``[B, S]``), else ``0..S-1`` per row
       (global positions, computed before sharding).
    2. ``shift_labels``: kept if present, else built from ``labels``: ``labels[:, 1:]`` followed by ``ignore_index``.
       Positions whose *target* token is padding (``attention_mask == 0``) or starts another packed document get
       ``ignore_index``.
    3. ``attention_mask`` is checked (only right padding is supported: causal attention then never lets a real token
       see a pad) and sharded like the rest; the prepared model accepts it and runs causal attention.
    4. ``S`` is padded to a multiple of ``sp_size``: ``input_ids`` with ``pad_token_id``, labels with
       ``ignore_index``, positions continue counting, any other ``[B, S, ...]`` tensor with 0.
    5. Every ``[B, S, ...]`` tensor is sliced to ``[:, sp_rank * s : (sp_rank + 1) * s]`` with ``s = S_padded / sp``.

    Non-tensor entries and tensors of other shapes pass through unchanged. The result also carries a
    :class:`~lightning_ulysses.context.ShardInfo` under ``"_ulysses"`` (full length, packed-document offsets), which
    the strategy removes before the LightningModule sees the batch.

    Packed documents: a row holds several documents when its ``position_ids`` restart (any position that is not the
    previous one + 1 starts a new document, the convention of Hugging Face's packing collators).
    """
    check_batch_contract(batch)
    input_ids = batch[INPUT_IDS]
    B, S = input_ids.shape
    digest = batch_fingerprint(batch) if fingerprint else None
    # `None` under a contract key means absent (collators write e.g. attention_mask=None).
    out = {k: v for k, v in batch.items() if not (v is None and k in _CONTRACT_KEYS)}

    attention_mask = out.get(ATTENTION_MASK)
    if attention_mask is not None:
        _check_right_padding(attention_mask)

    multimodal = None
    rope_positions = _take_multimodal_positions(out)  # [3 or 4, B, S] given M-RoPE positions, else None
    if rope_positions is not None or any(out.get(key) is not None for key in VISION_KEYS):
        # before position_ids are filled in: given ones only
        multimodal = {key: out[key] for key in _MULTIMODAL_TOKEN_KEYS if isinstance(out.get(key), torch.Tensor)}
        if rope_positions is not None:
            multimodal[POSITION_IDS] = rope_positions
    positions_filled = POSITION_IDS not in out
    if positions_filled:
        out[POSITION_IDS] = torch.arange(S, dtype=torch.long).expand(B, S)
    elif isinstance(out[POSITION_IDS], torch.Tensor) and tuple(out[POSITION_IDS].shape) == (1, S):
        out[POSITION_IDS] = out[POSITION_IDS].expand(B, S)  # Hugging Face's broadcast form: one row for all
    position_ids = out[POSITION_IDS]
    # [B, S] bool: True where a new document starts (every row starts one).
    document_start = torch.ones(B, S, dtype=torch.bool)
    document_start[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if attention_mask is not None:  # right padding: whatever positions the pads carry, they start no document
        document_start[:, 1:] &= attention_mask[:, 1:].bool()
    packed = bool(document_start[:, 1:].any())
    if LABELS in out and SHIFT_LABELS not in out:
        labels = out[LABELS]
        shift_labels = torch.full_like(labels, ignore_index)
        shift_labels[:, :-1] = labels[:, 1:]
        if attention_mask is not None:
            shift_labels[:, :-1][attention_mask[:, 1:] == 0] = ignore_index
        shift_labels[:, :-1][document_start[:, 1:]] = ignore_index  # a document never predicts the next one
        out[SHIFT_LABELS] = shift_labels

    # [B, S] bool: the token after position i is a target of i (inside the row, not a pad, not another document).
    target_valid = torch.zeros(B, S, dtype=torch.bool)
    target_valid[:, :-1] = ~document_start[:, 1:]
    if attention_mask is not None:
        target_valid[:, :-1] &= attention_mask[:, 1:].bool()

    geometry = SequenceGeometry(sp_size, ring_size)
    padded_len = geometry.padded_length(S)
    index = geometry.shard_index(padded_len, sp_rank)  # [s] positions of the padded row this rank holds
    span = geometry.contiguous_span(padded_len, sp_rank)  # the same as one slice (Ulysses only), else None

    def cut(value: torch.Tensor, key: str) -> torch.Tensor:  # [B, S, ...] -> [B, s, ...]
        if padded_len != S:
            value = _pad_sequence(value, key, padded_len, pad_token_id, ignore_index)
        return value[:, span].contiguous() if span is not None else value[:, index]

    for key, value in out.items():
        if key in VISION_KEYS:
            continue
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and tuple(value.shape[:2]) == (B, S):
            out[key] = cut(value, key)
    info = _shard_info(S, padded_len, document_start) if packed else ShardInfo(S)
    info.batch_size, info.fingerprint = B, digest
    info.position_ids = out[POSITION_IDS]
    info.positions_filled = positions_filled
    info.max_position = int(position_ids.max())  # the full batch's, as one device's rotary embedding sees it
    info.attention_mask = out.get(ATTENTION_MASK)
    grids = [out[key] for key in ("image_grid_thw", "video_grid_thw") if isinstance(out.get(key), torch.Tensor)]
    if grids:
        info.vision_grids = [tuple(int(n) for n in grid) for found in grids for grid in found.reshape(-1, 3).tolist()]
    info.target_valid = cut(target_valid, "target_valid")  # padded with False
    info.global_index = index
    info.padded_len = padded_len
    info.multimodal = multimodal
    info.halo = next_token_sources(padded_len, geometry, sp_rank)
    out[SHARD_INFO_KEY] = info
    return out


_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def check_batch_contract(batch: Any) -> None:
    """Raise a ``TypeError``/``ValueError`` naming the key and the expected shape unless ``batch`` is a dict with:

    * ``input_ids``: integer ``[B, S]`` (required);
    * ``labels``, ``shift_labels``: integer ``[B, S]``;
    * ``position_ids``: integer ``[B, S]`` or ``[1, S]`` (one row for all), or multimodal ``[4, B, S]`` / ``[3, B, S]``
      (see :func:`shard_batch`);
    * ``attention_mask``: ``[B, S]`` (1 = token, 0 = right padding); 4-D masks are refused.
    """
    if not isinstance(batch, Mapping) or INPUT_IDS not in batch:
        raise TypeError(
            "UlyssesDeepSpeedStrategy shards batches that are dicts with an `input_ids` tensor of shape [B, S]"
            f" (plus optional labels, position_ids, attention_mask, ...); got {type(batch).__name__}"
            + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
            + ". Return a dict from your Dataset or collate_fn."
        )
    input_ids = batch[INPUT_IDS]
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"The batch's `input_ids` must be an integer tensor of shape [B, S] (token ids), got"
                        f" {_describe(input_ids)}.")
    B, S = input_ids.shape
    for key in (LABELS, SHIFT_LABELS):
        if key in batch and batch[key] is not None:
            value = batch[key]
            if not (isinstance(value, torch.Tensor) and tuple(value.shape) == (B, S) and value.dtype in _INTEGER_DTYPES):
                raise ValueError(f"The batch's `{key}` must be an integer tensor of shape [B, S] = [{B}, {S}] like"
                                 f" `input_ids` (-100 where no loss is taken), got {_describe(value)}.")
    if POSITION_IDS in batch and batch[POSITION_IDS] is not None:
        value = batch[POSITION_IDS]
        if not (isinstance(value, torch.Tensor) and tuple(value.shape) in ((B, S), (1, S), (3, B, S), (4, B, S))
                and value.dtype in _INTEGER_DTYPES):
            raise ValueError(f"The batch's `position_ids` must be an integer tensor of shape [B, S] = [{B}, {S}] or"
                             f" [1, S] = [1, {S}] (one row for all), or a vision-language model's multimodal positions"
                             f" [4, B, S] (text positions first, then M-RoPE's three) or [3, B, S], got"
                             f" {_describe(value)}.")
    if ATTENTION_MASK in batch and batch[ATTENTION_MASK] is not None:
        value = batch[ATTENTION_MASK]
        if isinstance(value, torch.Tensor) and value.ndim == 4:
            raise ValueError(
                f"The batch's `attention_mask` is 4-D {_describe(value)}: custom attention masks cannot be split over"
                " sequence-parallel ranks and are not supported. The strategy runs causal attention and supports a"
                " [B, S] padding mask (right padding) and packed documents: give `position_ids` that restart at 0"
                " for every document (e.g. DataCollatorWithFlattening) and drop the 4-D mask."
            )
        if not (isinstance(value, torch.Tensor) and tuple(value.shape) == (B, S)):
            raise ValueError(f"The batch's `attention_mask` must be a [B, S] = [{B}, {S}] padding mask (1 = token,"
                             f" 0 = right padding), got {_describe(value)}.")


def _take_multimodal_positions(out: dict[str, Any]) -> Optional[torch.Tensor]:
    """A vision-language model's multimodal positions given by the batch (``[4, B, S]``: the text positions, which
    restart per packed sample, then M-RoPE's temporal, height and width rows; or ``[3, B, S]`` without the text row),
    taken out of ``out``; the text row (if any) stays as the batch's 1-D ``position_ids`` for cutting, packing and
    labels, exactly what transformers' M-RoPE models read for their packed mask. ``None`` for 1-D positions."""
    value = out.get(POSITION_IDS)
    if not (isinstance(value, torch.Tensor) and value.ndim == 3):
        return None
    del out[POSITION_IDS]
    if value.shape[0] == 4:
        out[POSITION_IDS] = value[0]  # [B, S] text positions
    return value


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} of shape {list(value.shape)}"
    return type(value).__name__


def _shard_info(seq_len: int, padded_len: int, document_start: torch.Tensor) -> ShardInfo:
    """Document offsets in the flattened ``[B × padded_len]`` batch (padding extends each row's last document)."""
    B = document_start.shape[0]
    rows, cols = document_start.nonzero(as_tuple=True)
    starts = rows * padded_len + cols
    cu_seqlens = torch.cat([starts, torch.tensor([B * padded_len])]).to(torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return ShardInfo(seq_len, cu_seqlens, max_seqlen)


def _pad_sequence(value: torch.Tensor, key: str, padded_len: int, pad_token_id: int, ignore_index: int) -> torch.Tensor:
    B, S = value.shape[:2]
    if key == POSITION_IDS:
        extra = value[:, -1:] + torch.arange(1, padded_len - S + 1, dtype=value.dtype)
        return torch.cat([value, extra], dim=1)
    fill = {INPUT_IDS: pad_token_id, LABELS: ignore_index, SHIFT_LABELS: ignore_index}.get(key, 0)
    pad = torch.full((B, padded_len - S, *value.shape[2:]), fill, dtype=value.dtype)
    return torch.cat([value, pad], dim=1)


def _check_right_padding(attention_mask: torch.Tensor) -> None:
    mask = attention_mask.bool()
    # Right padding: once a row has a 0, it has only 0s after it, i.e. the mask never rises from 0 to 1.
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError(
            "The batch's attention_mask has padding before real tokens (left padding) or holes. Under sequence"
            " parallelism the mask is replaced by causal attention, which is exact only for right padding:"
            " set `tokenizer.padding_side = 'right'` (and label padded positions -100)."
        )


class SequenceShardingCollate:
    """Wraps a collate function so that it returns this SP rank's shard of the batch (see :func:`shard_batch`).

    Args:
        sp_size: ranks per SP group.
        sp_rank: this rank's position in its SP group.
        collate_fn: the user's collate function; ``None`` means PyTorch's ``default_collate``.
        pad_token_id: token used to pad the sequence to a multiple of ``sp_size``.
    """

    def __init__(
        self, sp_size: int, sp_rank: int, collate_fn: Optional[Callable] = None, pad_token_id: int = 0,
        fingerprint: bool = False, ring_size: int = 1,
    ) -> None:
        self.sp_size = sp_size
        self.sp_rank = sp_rank
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.pad_token_id = pad_token_id
        self.fingerprint = fingerprint
        self.ring_size = ring_size

    def __call__(self, samples: Any) -> dict[str, Any]:
        return shard_batch(self.collate_fn(samples), self.sp_size, self.sp_rank, self.pad_token_id,
                           fingerprint=self.fingerprint, ring_size=self.ring_size)


def install_sharding_collate(dataloader: DataLoader, sp_size: int, sp_rank: int, pad_token_id: int,
                             fingerprint: bool = False, ring_size: int = 1) -> DataLoader:
    """Make ``dataloader`` yield shards; a loader that already has the step gets it re-targeted, not stacked."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"UlyssesDeepSpeedStrategy needs torch DataLoaders to install its sequence-sharding collate step,"
            f" got {type(dataloader).__name__}."
        )
    user_collate = dataloader.collate_fn
    if isinstance(user_collate, SequenceShardingCollate):
        user_collate = user_collate.collate_fn
    if dataloader.batch_size is None and dataloader.batch_sampler is None:
        raise ValueError(automatic_batching_off_error())
    dataloader.collate_fn = SequenceShardingCollate(sp_size, sp_rank, user_collate, pad_token_id, fingerprint,
                                                    ring_size)
    return dataloader


def automatic_batching_off_error() -> str:
    # Automatic batching off: PyTorch calls collate_fn per sample, which cannot be sharded as a batch.
    return ("UlyssesDeepSpeedStrategy needs batched DataLoaders: `DataLoader(batch_size=None)` turns automatic"
            " batching off, so there is no [B, S] batch to cut into sequence shards. Use `batch_size=1` (or more),"
            " or a `batch_sampler`.")
