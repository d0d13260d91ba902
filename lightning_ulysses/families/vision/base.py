"""What the vision path asks of a vision-language family: how its batch's vision items cut into independent units
of the vision tower, how a run of units is encoded, and where its positions come from.

A family is one subclass of :class:`VisionFamily` in a module of this folder and one entry in
:data:`lightning_ulysses.families.vision.FAMILIES`; the placement of the feature rows on the shards, the
exchange, the dummy item on ranks without a unit and the agreement on modalities are the same for every family
(:mod:`lightning_ulysses.models.vision_language`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lightning_ulysses.context import ShardInfo


@dataclass(frozen=True)
class Modality:
    """One kind of vision input: its name in ``mm_encoder_outputs`` (``"image"`` / ``"video"``), the batch key of its
    pixels, and the config attribute holding its placeholder token id."""

    name: str
    pixels_key: str
    token_attr: str


IMAGE = Modality("image", "pixel_values", "image_token_id")
VIDEO = Modality("video", "pixel_values_videos", "video_token_id")


@dataclass(frozen=True)
class Units:
    """The batch's items of one modality cut into the vision tower's independent units, in feature-row order.

    Attributes:
        sizes: per unit, its work (patches), for balancing the units over the SP ranks.
        rows: per unit, the feature rows it gives; ``None`` when only encoding tells (then the ranks exchange their
            units' row counts, one small all-reduce).
    """

    sizes: list[int]
    rows: Optional[list[int]]


@dataclass(frozen=True)
class Encoded:
    """A run of units through the vision tower.

    Attributes:
        tensors: ``[t, H_k]`` each, ``t`` the run's feature rows in order; the first is written into the
            placeholders' embeddings, any further ones (e.g. Qwen3-VL's deepstack features) travel with it.
        rows_per_unit: the feature rows of each unit of the run, for a family whose :class:`Units` has no ``rows``.
    """

    tensors: list[torch.Tensor]
    rows_per_unit: Optional[list[int]] = None


class VisionFamily:
    """The per-family part of the vision path (see the module docstring). Subclasses set :attr:`model_types` and
    :attr:`modalities` and implement :meth:`units`, :meth:`slice_inputs`, :meth:`dummy_inputs` and
    :meth:`encode_inputs`."""

    model_types: tuple[str, ...] = ()
    modalities: tuple[Modality, ...] = (IMAGE,)
    # 1-D text positions (None) or the keyword arguments of the model's `get_rope_index` beyond ids, token types,
    # grids and mask (multimodal RoPE, computed on the whole batch's ids).
    rope_index_keys: Optional[tuple[str, ...]] = None

    def units(self, inner: nn.Module, modality: Modality, named: dict[str, Any], shard: ShardInfo) -> Units:
        raise NotImplementedError

    def slice_inputs(self, inner: nn.Module, modality: Modality, named: dict[str, Any], first: int,
                     last: int) -> dict[str, Any]:
        """The inputs of units ``first`` to ``last - 1`` (the batch's own keys for this modality, cut)."""
        raise NotImplementedError

    def dummy_inputs(self, inner: nn.Module, modality: Modality) -> dict[str, Any]:
        """The smallest input the vision tower takes (zeros), in the form of :meth:`slice_inputs`."""
        raise NotImplementedError

    def encode_inputs(self, inner: nn.Module, modality: Modality, inputs: dict[str, Any]) -> Encoded:
        """The items in ``inputs`` (the form of :meth:`slice_inputs`) through the vision tower."""
        raise NotImplementedError

    def encoder_output(self, tensors: list[torch.Tensor]) -> Any:
        """What the model's forward takes under ``mm_encoder_outputs[modality]`` for these rows."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        return BaseModelOutputWithPooling(pooler_output=(tensors[0],))

    def complete_attention(self, model: nn.Module, named: dict[str, Any], shard: Optional[ShardInfo],
                           context: Any) -> None:
        """Anything the family's attention needs beyond causal attention, added to the call ``named`` in place
        before its forward (every call, text-only ones too; e.g. Gemma 3's bidirectional image blocks). Default:
        nothing."""

    def consumed_keys(self, modality: Modality) -> tuple[str, ...]:
        """The batch keys the model must not get once its features are given (it refuses both)."""
        return (modality.pixels_key,)

    def call_options(self, named: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments of the model's call that its forward passes on to its feature methods (e.g.
        LLaVA-NeXT's ``vision_feature_layer``), added to every encoding's inputs of the call, a dummy's too, so that
        each rank's vision tower runs as the call asks. Default: none."""
        return {}

    def modality_output(self, modality: Modality, tensors: list[torch.Tensor]) -> Any:
        """What the model's forward takes under ``mm_encoder_outputs[modality.name]``: :meth:`encoder_output`, unless
        the family's forward takes its modalities in different forms."""
        return self.encoder_output(tensors)


def encoder_rows(output: Any) -> torch.Tensor:
    """``[N, H]``: a ``get_*_features`` output's feature rows of all its items, in item order."""
    pooled = output.pooler_output
    return torch.cat(list(pooled), dim=0) if isinstance(pooled, (list, tuple)) else pooled
