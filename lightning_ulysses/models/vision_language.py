"""Vision-language models under sequence parallelism: images and videos in the batch, the decoder on shards.

A vision-language model (Qwen2-VL, Qwen2.5-VL) embeds its text tokens, encodes its images and videos with a vision
tower, writes each image-feature row into the embedding of one placeholder token (``masked_scatter`` in token
order), and runs its decoder with multimodal positions (M-RoPE: temporal, height and width position per token,
computed from the whole row's layout of text and image tokens). Cut into shards as a text model would be, every rank
would encode all images while holding the placeholders of its own shard only (transformers stops: "Image features
and image tokens do not match"), and compute the positions of its shard as if it were the whole row.

Here, inside a step, a prepared model's call is completed before its forward runs:

* **positions**: the model's own ``get_rope_index`` runs on the whole batch's token ids (kept by the collate step in
  :attr:`ShardInfo.multimodal <lightning_ulysses.context.ShardInfo>`: ids, not activations) exactly as on one device,
  and this rank takes the columns of its shard: ``[3, B, S] -> [3, B, s]``, passed with the text positions in front
  (``[4, B, s]``, transformers' packed form);
* **image and video features**: the vision tower runs on the batch's images (every rank, the same input), and this
  rank keeps the feature rows of the placeholder tokens its shard holds, in token order (an image whose tokens
  straddle a shard boundary gives its first rows to one rank and the rest to the next); they reach the model as
  ``mm_encoder_outputs``, so its own ``masked_scatter`` places them. Each rank back-propagates through its rows only,
  and DeepSpeed's sum over the ranks gives the vision tower one device's gradient.

Families are listed in :data:`SUPPORTED_FAMILIES`; a batch with images or videos for any other vision-language model
is refused before its forward with that list.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_ulysses.context import ShardInfo

# model_type -> how the family is called: its keyword arguments of get_rope_index beyond the grids and the mask.
SUPPORTED_FAMILIES: dict[str, tuple[str, ...]] = {
    "qwen2_vl": (),
    "qwen2_5_vl": ("second_per_grid_ts",),
}
_MODALITIES = (("image", "pixel_values", "image_grid_thw", "image_token_id"),
               ("video", "pixel_values_videos", "video_grid_thw", "video_token_id"))


def is_vision_language_model(model: nn.Module) -> bool:
    """A Hugging Face model with a vision tower (its config has a ``vision_config``)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def keep_vision_attention(model: nn.Module, implementation: str) -> None:
    """The vision tower attends over its own patches, never over sequence shards: its config keeps the attention
    implementation ``implementation`` when the model's config was pointed at the strategy's functions (transformers
    passes the top config's implementation down to every sub-config)."""
    from lightning_ulysses import _compat

    vision = getattr(model.config, "vision_config", None)
    if vision is not None:
        _compat.set_attention_implementation(vision, implementation)


def has_vision_inputs(named: dict[str, Any]) -> bool:
    return any(named.get(key) is not None for _, key, _, _ in _MODALITIES)


def unsupported_family_error(model: nn.Module) -> str:
    model_type = getattr(model.config, "model_type", type(model).__name__)
    return (
        f"{type(model).__name__} ({model_type!r}) was called with images or videos under sequence parallelism, which"
        f" the strategy supports for the vision-language families {sorted(SUPPORTED_FAMILIES)}: for this one it does"
        " not know how the image features and the multimodal positions are placed on the sequence shards. Train it"
        " on text-only batches, use sp_size=1, or one of the supported families."
    )


def complete_call(model: nn.Module, named: dict[str, Any], shard: ShardInfo) -> None:
    """Fill a vision-language model's call of a step in place (see the module docstring): ``position_ids`` become the
    shard's multimodal positions ``[4, B, s]``; ``pixel_values`` / ``pixel_values_videos`` become the shard's rows of
    the encoded features (``mm_encoder_outputs``)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_FAMILIES:
        raise ValueError(unsupported_family_error(model))
    multimodal = shard.multimodal
    if multimodal is None:
        raise ValueError(
            f"{type(model).__name__} was called with images or videos that were not in the step's batch: the"
            " strategy places image features on the shards from the batch the collate step cut. Pass the batch's"
            " `pixel_values` / `image_grid_thw` (and video keys) in the batch itself."
        )
    inner = _base_model(model)
    rows = int(named["position_ids"].shape[0])
    text_positions = named["position_ids"]  # [B, s] global 1-D positions of the shard
    named["position_ids"] = torch.cat([text_positions[None], _shard_rope_positions(inner, named, shard, model_type,
                                                                                   rows, text_positions.device)])
    encoded = dict(named.get("mm_encoder_outputs") or {})
    for modality, pixels_key, grid_key, token_key in _MODALITIES:
        pixels = named.pop(pixels_key, None)
        if pixels is None:
            continue
        features = _encode(inner, modality, pixels, named.get(grid_key))  # [N_tokens_total, H]
        token_id = getattr(model.config, token_key)
        encoded[modality] = _as_encoder_output(_shard_rows(features, multimodal["input_ids"], token_id, shard, rows))
    if encoded:
        named["mm_encoder_outputs"] = encoded


def _base_model(model: nn.Module) -> nn.Module:
    """The module holding ``get_rope_index`` and the vision feature methods (``model.model`` of the
    ``...ForConditionalGeneration`` classes)."""
    inner = getattr(model, "model", model)
    if not hasattr(inner, "get_rope_index"):
        raise ValueError(unsupported_family_error(model))
    return inner


def _shard_rope_positions(inner: nn.Module, named: dict[str, Any], shard: ShardInfo, model_type: str, rows: int,
                          device: torch.device) -> torch.Tensor:
    """``[3, rows, s]``: the model's multimodal positions of the whole batch, this shard's columns."""
    multimodal = shard.multimodal
    ids = multimodal["input_ids"]  # [B, S] the whole batch's tokens
    token_types = multimodal.get("mm_token_type_ids")
    if token_types is None:
        token_types = _token_types(inner.config, ids)
    extra = {key: named.get(key) for key in SUPPORTED_FAMILIES[model_type] if named.get(key) is not None}
    with torch.no_grad():
        whole, _ = inner.get_rope_index(ids.to(device), token_types.to(device),
                                        image_grid_thw=named.get("image_grid_thw"),
                                        video_grid_thw=named.get("video_grid_thw"),
                                        attention_mask=_mask_or_none(multimodal, device), **extra)  # [3, B, S]
    S = ids.shape[1]
    if shard.padded_len > S:  # the padding to the SP multiple continues counting after each row's last position
        tail = whole[:, :, -1:] + torch.arange(1, shard.padded_len - S + 1, device=device)
        whole = torch.cat([whole, tail], dim=2)  # [3, B, S_pad]
    return whole[:, :rows, shard.global_index.to(device)]  # [3, rows, s]


def _mask_or_none(multimodal: dict[str, torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    mask = multimodal.get("attention_mask")
    return None if mask is None else mask.to(device)


def _token_types(config: Any, ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` 0 text, 1 image, 2 video placeholder (what the processor returns as ``mm_token_type_ids``)."""
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == config.image_token_id] = 1
    types[ids == config.video_token_id] = 2
    return types


def _encode(inner: nn.Module, modality: str, pixels: torch.Tensor, grid: Optional[torch.Tensor]) -> torch.Tensor:
    """``[N, H]``: the feature rows of every image (or video) of the batch, in the order of their placeholders."""
    method = inner.get_image_features if modality == "image" else inner.get_video_features
    output = method(pixels, grid, return_dict=True)
    return torch.cat(list(output.pooler_output), dim=0)


def _shard_rows(features: torch.Tensor, ids: torch.Tensor, token_id: int, shard: ShardInfo, rows: int
                ) -> torch.Tensor:
    """The rows of ``features`` (one per placeholder token of the whole batch, in row-major token order) whose
    placeholders this rank's shard holds, in the shard's token order."""
    placeholder = ids == token_id  # [B, S]
    number = placeholder.flatten().long().cumsum(0).view(placeholder.shape) - 1  # [B, S]: index of each placeholder
    S = ids.shape[1]
    index = shard.global_index  # [s] positions of the padded row this rank holds
    real = index < S
    mine = torch.zeros((ids.shape[0], index.shape[0]), dtype=torch.bool)  # [B, s]
    mine[:, real] = placeholder[:, index[real]]
    taken = number[:, index.clamp(max=S - 1)][mine[:rows].nonzero(as_tuple=True)]  # [n] row numbers in shard order
    return features[taken.to(features.device)]  # [n, H]


def _as_encoder_output(rows: torch.Tensor) -> Any:
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    return BaseModelOutputWithPooling(pooler_output=(rows,))
