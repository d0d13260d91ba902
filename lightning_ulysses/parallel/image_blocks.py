"""Causal attention in which the tokens of each image attend to each other both ways (Gemma 3's training mask),
computed exactly without an ``[S, S]`` mask.

Gemma 3 lets the placeholder tokens of one image (a maximal run of ``token_type_ids == 1``, transformers'
``get_block_sequence_ids_for_mask``) see each other bidirectionally, on top of causal attention; on its sliding
layers the window applies to that as well (transformers: ``AND(sliding_window, OR(causal, same block))``). So a
query ``q`` inside an image block ``[a, b)`` may see exactly:

* full attention: keys ``[0, b)`` (the causal prefix and the rest of its block), no mask;
* sliding window ``w``: keys ``[q - w + 1, b)``: the keys ``[max(0, a - w + 1), b)`` with the mask
  ``key > query - w`` (``[b - a, b - max(0, a - w + 1)]``);

and every query outside a block sees what causal (windowed) attention gives it. :func:`attend_image_blocks` takes
the causal output of all queries and replaces the rows of each block's queries by that attention, out of place
(a differentiable concatenation), so the causal kernel stays what it is for everything else.

Positions are global positions of the whole (padded) row, what the attention sees after the sequence-to-head
exchange; blocks never cover padding (images are real tokens, right padding comes after them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

# attend(q [B', h, lq, D], k [B', hkv, lk, D], v, mask [lq, lk] bool (True = attend) or None = every key)
#   -> [B', lq, h, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


# The keyword of a model call (and so of its attention calls) that carries its bidirectional image blocks.
IMAGE_BLOCKS_KWARG = "ulysses_image_blocks"


def refuse_unsupported_image_blocks(name: str, inner_name: str, ring_size: int, packed: bool,
                                    causal: bool = True) -> None:
    """Bidirectional image blocks are exact with ``sdpa``, Ulysses only (``ring_size=1``), one sample per row, on a
    causal decoder; refuse anything else before it computes."""
    problem = None
    if inner_name != "sdpa":
        problem = (f"attn_implementation {inner_name!r}: the block attention runs through 'sdpa' only; load the model"
                   " with attn_implementation='sdpa'")
    elif ring_size > 1:
        problem = (f"ring attention (ring_size={ring_size}) does not attend within image blocks; use"
                   " ring_size=1 (Ulysses only)")
    elif packed:
        problem = "rows that pack several samples; give one sample per row (right-padded)"
    elif not causal:
        problem = "a layer that attends bidirectionally already (use_bidirectional_attention); train it causal"
    if problem is not None:
        raise ValueError(
            f"{name} is called with image tokens that attend to each other both ways (`token_type_ids` marks image"
            " blocks), which sequence parallelism supports exactly except with"
            f" {problem}. Or leave `token_type_ids` out of the call (then every token attends causally, as one"
            " device does without them)."
        )


@dataclass(frozen=True)
class ImageBlocks:
    """The bidirectional blocks of a call: ``(row, start, end)`` per block, ``[start, end)`` global positions."""

    spans: tuple[tuple[int, int, int], ...]

    @classmethod
    def from_token_types(cls, token_types: torch.Tensor) -> "ImageBlocks":
        """The maximal runs of ``token_types == 1`` of each row of ``[B, S]`` (what transformers' Gemma 3 makes
        its bidirectional blocks of)."""
        is_image = (token_types == 1).to("cpu", torch.int8)  # [B, S]
        edges = torch.diff(torch.nn.functional.pad(is_image, (1, 1)), dim=1)  # [B, S + 1]: +1 a start, -1 an end
        starts, ends = (edges == 1).nonzero().tolist(), (edges == -1).nonzero().tolist()  # row-major, paired in order
        return cls(tuple((row, start, end) for (row, start), (_, end) in zip(starts, ends)))

    def __bool__(self) -> bool:
        return bool(self.spans)


def block_keys(start: int, end: int, window: Optional[int]) -> tuple[int, int]:
    """``(first, last)``: the keys ``[first, last)`` that some query of the block ``[start, end)`` may see."""
    return (0 if window is None else max(0, start - window + 1)), end


def block_mask(start: int, end: int, window: Optional[int], device: torch.device) -> Optional[torch.Tensor]:
    """``[end - start, end - first]`` bool, True = attend: the block's queries over its keys (:func:`block_keys`);
    ``None`` when every key is seen (full attention, or a window that reaches back past the first key)."""
    first, last = block_keys(start, end, window)
    if window is None or end - window <= first:  # even the block's last query sees every key from `first`
        return None
    queries = torch.arange(start, end, device=device)
    keys = torch.arange(first, last, device=device)
    return keys[None, :] > queries[:, None] - window  # [lq, lk]


def attend_image_blocks(attend: Attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: torch.Tensor,
                        blocks: ImageBlocks, window: Optional[int] = None) -> torch.Tensor:
    """``causal [B, S, h, D]`` (causal, windowed with ``window``, attention of ``q [B, h, S, D]`` over
    ``k, v [B, hkv, S, D]``) with the rows of every block's queries replaced by their attention over the keys the
    block lets them see (module docstring). Out of place; ``causal`` is returned as is without blocks."""
    if not blocks:
        return causal
    per_row: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
    for row, start, end in blocks.spans:
        first, last = block_keys(start, end, window)
        mask = block_mask(start, end, window, q.device)
        rows = attend(q[row:row + 1, :, start:end], k[row:row + 1, :, first:last], v[row:row + 1, :, first:last],
                      mask)  # [1, end - start, h, D]
        per_row.setdefault(row, []).append((start, end, rows[0]))
    out_rows = []
    for row in range(causal.shape[0]):
        pieces, cursor = [], 0
        for start, end, rows in sorted(per_row.get(row, []), key=lambda piece: piece[0]):
            pieces += [causal[row, cursor:start], rows]
            cursor = end
        out_rows.append(torch.cat(pieces + [causal[row, cursor:]]) if pieces else causal[row])  # [S, h, D]
    return torch.stack(out_rows)  # [B, S, h, D]


def dense_reference_mask(blocks: ImageBlocks, rows: int, length: int, window: Optional[int] = None) -> torch.Tensor:
    """``[rows, length, length]`` bool, True = attend: the same attention as one dense mask (transformers'
    composition: ``(causal OR same block) AND window``), for tests and checks on short rows."""
    positions = torch.arange(length)
    block = torch.full((rows, length), -1)
    for number, (row, start, end) in enumerate(blocks.spans):
        block[row, start:end] = number
    same = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] >= 0)  # [rows, L, L]
    allowed = (positions[None, :] <= positions[:, None])[None] | same
    if window is not None:
        allowed &= (positions[None, :] > positions[:, None] - window)[None]
    return allowed
