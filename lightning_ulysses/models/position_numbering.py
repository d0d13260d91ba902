"""Models that number their positions themselves from the token ids when given none: RoBERTa-style embeddings
(``create_position_ids_from_input_ids``: XLM-R, CamemBERT, Data2Vec-text, X-MOD, ESM, ...) start at
``padding_idx + 1`` and give padding ``padding_idx``.

The strategy fills a call's missing ``position_ids`` with the shard's global positions ``0..S-1``. For such a model
one device would have used ``padding_idx + 1 + p`` instead, so every learned position embedding would be the
neighbour's, silently (measured: update 1.4 off, relative). Here the filled positions are numbered as the model
numbers them, on the whole row: ``padding_idx + 1 + p`` for a token, ``padding_idx`` for a padding token. This
equals the model's own numbering (a running count of the non-padding tokens) for right-padded rows, the only padding
the strategy takes.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

_FOUND: "weakref.WeakKeyDictionary[nn.Module, Optional[int]]" = weakref.WeakKeyDictionary()


def own_numbering_padding_index(model: nn.Module) -> Optional[int]:
    """``padding_idx`` of the model's embeddings when they number positions from the token ids (RoBERTa-style), else
    ``None`` (looked up once per model)."""
    if model not in _FOUND:
        _FOUND[model] = next((int(m.padding_idx) for m in model.modules()
                              if callable(getattr(m, "create_position_ids_from_input_ids", None))
                              and isinstance(getattr(m, "padding_idx", None), int)), None)
    return _FOUND[model]


def numbered_as_the_model_does(positions: torch.Tensor, ids: Optional[torch.Tensor],
                               padding_index: Optional[int]) -> torch.Tensor:
    """``positions`` ``[B, s]`` (global, from 0) as the model would number them without ``position_ids``."""
    if padding_index is None or ids is None or ids.dtype.is_floating_point:
        return positions
    ids = ids.to(positions.device)
    return torch.where(ids != padding_index, positions + padding_index + 1,
                       torch.full_like(positions, padding_index))  # [B, s]
