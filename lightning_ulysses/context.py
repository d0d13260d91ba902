"""What the collate step knows about a batch and the attention and loss need during its step.

The collate step attaches a :class:`ShardInfo` to each batch under the key ``"_ulysses"``; the strategy's loader takes
it out as the batch leaves the DataLoader (before any Lightning or user hook sees the batch) and queues it, and the
step of that batch moves it into the :class:`~lightning_ulysses.training.step_context.StepContext` that the
prepared models' attention and loss read.
Nothing of it reaches the user's hooks or ``model(**batch)``.
"""

from __future__ import annotations

from typing import Optional

import torch

SHARD_INFO_KEY = "_ulysses"
IGNORE_INDEX = -100  # the label of a position that carries no target (PyTorch's and Hugging Face's convention)


class ShardInfo:
    """Facts about the full batch a shard was cut from (a plain object: Lightning neither moves nor sizes it).

    Attributes:
        seq_len: length ``S`` of the full batch before padding to a multiple of sp.
        cu_seqlens: ``[num_segments + 1]`` int32 offsets of the documents in the flattened, padded ``[B × S_pad]``
            batch, or ``None`` when no row is packed (each row is one causal sequence).
        max_seqlen: length of the longest document (``None`` when not packed).
        window_tokens: this rank's count of target tokens over the whole gradient-accumulation window the batch
            belongs to (set by the train loader when accumulating), else ``None``.
        batch_size: rows ``B`` of the full batch.
        fingerprint: digest of the full batch (:func:`lightning_ulysses.data.fingerprint.batch_fingerprint`), compared
            between SP peers before the step; ``None`` when the check is off.
        position_ids: ``[B, s]`` global positions of this rank's shard (what a model call without ``position_ids``
            gets).
        attention_mask: ``[B, s]`` this rank's shard of the batch's padding mask (checked: right padding), or
            ``None`` when the batch had none.
        target_valid: ``[B, s]`` bool: whether the token after each position is a target of it (not padding, not the
            start of another packed document, not past the end of the row); shifting labels inside a step uses it.
        global_index: ``[s]`` positions in the padded row that this rank holds (contiguous, or zigzag with ring).
        padded_len: the row length after padding to the SP layout's multiple.
        halo: where the token after each run of this shard lives (:class:`lightning_ulysses.data.halo.HaloPlan`).
        max_position: the largest ``position_ids`` value of the full batch (before the padding to the SP multiple):
            what a single device's length-dependent RoPE sees (:mod:`lightning_ulysses.models.rope`).
        multimodal: for a batch with images or videos, the full batch's token tensors ``{"input_ids",
            "mm_token_type_ids", "attention_mask", "position_ids"}`` as the batch gave them (``[B, S]`` each, before
            the padding; token ids and positions, never activations): what a vision-language model's multimodal
            positions and the placement of its image features are computed from
            (:mod:`lightning_ulysses.models.vision_language`). ``None`` otherwise.
        positions_filled: the batch had no ``position_ids`` and the collate step filled in ``0..S-1``: a model that
            numbers its positions itself when given none (RoBERTa-style) gets its own numbering
            (:mod:`lightning_ulysses.models.position_numbering`).
        vision_grids: the batch's images and videos as the processor's ``(t, h, w)`` grids in patches
            (``image_grid_thw`` then ``video_grid_thw``), for the pre-flight memory plan; ``None`` without them.
    """

    __slots__ = ("seq_len", "cu_seqlens", "max_seqlen", "window_tokens", "batch_size", "fingerprint",
                 "position_ids", "attention_mask", "target_valid", "global_index", "padded_len", "halo",
                 "max_position", "multimodal", "positions_filled", "vision_grids")

    def __init__(self, seq_len: int, cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                 window_tokens: Optional[torch.Tensor] = None, batch_size: int = 1,
                 fingerprint: Optional[int] = None) -> None:
        self.seq_len = seq_len
        self.cu_seqlens = cu_seqlens
        self.max_seqlen = max_seqlen
        self.window_tokens = window_tokens
        self.batch_size = batch_size
        self.fingerprint = fingerprint
        self.position_ids: Optional[torch.Tensor] = None
        self.attention_mask: Optional[torch.Tensor] = None
        self.target_valid: Optional[torch.Tensor] = None
        self.global_index: Optional[torch.Tensor] = None
        self.padded_len = seq_len
        self.halo = None
        self.max_position: Optional[int] = None
        self.multimodal: Optional[dict[str, torch.Tensor]] = None
        self.positions_filled = False
        self.vision_grids: Optional[list[tuple[int, int, int]]] = None

    @property
    def shard_shape(self) -> Optional[tuple[int, int]]:
        """``(B, s)`` of this rank's shard (``None`` if unknown)."""
        return None if self.position_ids is None else (int(self.position_ids.shape[0]), int(self.position_ids.shape[1]))

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def __getstate__(self):  # DataLoader workers pickle it
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state) -> None:
        for name, value in zip(self.__slots__, state):
            setattr(self, name, value)
