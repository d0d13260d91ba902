"""Multimodal (M-RoPE) positions of a whole batch, cut to a shard; and the packing rule of M-RoPE decoders.

Qwen2-VL-style decoders take positions ``[4, B, S]``: the text positions first (which restart per packed sample, and
from which transformers builds the packed attention mask), then M-RoPE's temporal, height and width rows. Given
``[B, S]`` positions, these decoders use them on all three axes and build **no** packed mask: on one device the
samples of a packed row then attend to each other. Under SP the strategy attends per packed sample, so flat packed
positions on such a decoder would train a different model than one device does; they are refused
(:func:`refuse_flat_packed_positions`) with the fix: give the ``[4, B, S]`` positions, with which one device's
flash-attention (varlen) attends per sample too. (Plain transformers on ``sdpa``/``eager`` never keeps packed samples
apart, measured on transformers 5.23; the strategy's per-sample attention is what packing promises.)
"""

from __future__ import annotations



import torch
from torch import nn

from lightning_ulysses.context import ShardInfo

# transformers 5.24's modeling modules whose decoders read packed samples only from [4, B, S] positions (a guard in
# tests/test_compat.py re-derives this set from the installed sources).
PACKING_FROM_FOUR_ROWS = frozenset({
    "cohere_compass", "cosmos3_edge", "ernie4_5_vl_moe", "glm4v", "glm4v_moe", "glm_image", "glm_ocr",
    "paddleocr_vl", "qwen2_5_omni", "qwen2_5_vl", "qwen2_vl", "qwen3_5", "qwen3_5_moe", "qwen3_omni_moe", "qwen3_vl",
    "hy_v4_vl", "qwen3_vl_moe", "qwen4_exp",
})


def reads_packing_from_four_rows(model: nn.Module) -> bool:
    """Whether ``model``'s decoder is one of :data:`PACKING_FROM_FOUR_ROWS` (by its modeling module)."""
    module = type(model).__module__.split(".")
    return len(module) >= 2 and module[-1].startswith("modeling_") and module[-2] in PACKING_FROM_FOUR_ROWS


def given_multimodal_positions(shard: ShardInfo) -> bool:
    """The batch gave M-RoPE positions (``[4, B, S]`` or ``[3, B, S]``)."""
    positions = (shard.multimodal or {}).get("position_ids")
    return isinstance(positions, torch.Tensor) and positions.ndim == 3


def refuse_flat_packed_positions(model: nn.Module, shard: ShardInfo) -> None:
    """Raise if ``shard`` packs several samples per row with ``[B, S]`` positions on a decoder that reads packing only
    from ``[4, B, S]`` positions (see the module docstring)."""
    if shard.packed and not given_multimodal_positions(shard) and reads_packing_from_four_rows(model):
        raise ValueError(
            f"{type(model).__name__} was given rows that pack several samples with [B, S] `position_ids` (they"
            " restart). This decoder builds its packed attention mask only from [4, B, S] positions (text positions"
            " first, then its three M-RoPE rows): with [B, S] positions one device lets the packed samples attend to"
            " each other, while sequence parallelism attends per sample, so the two would train different models."
            " Give `position_ids` of shape [4, B, S]: row 0 the text positions restarting per sample, rows 1-3 each"
            " sample's M-RoPE positions (e.g. `model.model.get_rope_index` on each sample, concatenated; for text-only"
            " rows the text positions on all four rows)."
        )


def shard_columns(whole: torch.Tensor, shard: ShardInfo, rows: int, device: torch.device) -> torch.Tensor:
    """``[k, rows, s]``: the shard's columns of whole-batch positions ``[k, B, S]``; the padding to the SP multiple
    continues counting after each row's last position on every axis."""
    S = whole.shape[2]
    whole = whole.to(device)
    if shard.padded_len > S:
        tail = whole[:, :, -1:] + torch.arange(1, shard.padded_len - S + 1, device=device, dtype=whole.dtype)
        whole = torch.cat([whole, tail], dim=2)  # [k, B, S_pad]
    return whole[:, :rows, shard.global_index.to(device)]  # [k, rows, s]


def multimodal_call_positions(text_positions: torch.Tensor, whole: torch.Tensor, shard: ShardInfo,
                              rows: int) -> torch.Tensor:
    """``[4, rows, s]``: the shard's text positions ``[rows, s]`` in front of its columns of M-RoPE positions
    ``whole`` (``[3, B, S]``, or ``[4, B, S]`` whose own text row is dropped: the shard's equals it)."""
    rope = whole[1:] if whole.shape[0] == 4 else whole  # [3, B, S]
    return torch.cat([text_positions[None], shard_columns(rope, shard, rows, text_positions.device)])


