"""Tiny LLaVA-NeXT (CLIP tower, Llama decoder) and LLaVA-OneVision (SigLIP tower, Qwen2 decoder) models built from
configs (hidden 32, 2 layers, 16-pixel tiles of 4-pixel patches, a grid of at most 2 × 2 tiles), and their batches the
way users get them.

Images go through the families' own image processors (PIL backend, built locally with a tiny
``image_grid_pinpoints``): ``pixel_values [images, tiles, C, 16, 16]`` (tiles padded to the batch's most),
``image_sizes``, OneVision's ``batch_num_images``. The placeholders per image and video are what the families' own
processors write, counted by their ``replace_image_token`` / ``replace_video_token`` (the processors are built
without their constructor: OneVision's needs its video processor, which needs torchvision, not installed; and there
is no tokenizer). A OneVision video is frames through the image processor (its base tile: the frame resized to the
tower's 16 pixels, rescaled and normalized, as the video processor does).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from tests.support.vision import IMAGE, SEED, VIDEO, _text

FAMILIES = ("llava_next", "llava_onevision")
TILE, PATCH = 16, 4  # pixels per tile side (the tower's image size) and per patch side: 16 patches per tile
PINPOINTS = [[16, 16], [16, 32], [32, 16], [32, 32]]  # grid resolutions: 1 × 1 up to 2 × 2 tiles
PINPOINTS_NEXT = PINPOINTS[1:]  # LLaVA-NeXT's grid always has two tiles or more
ASPECT = "anyres_max_1"  # OneVision shrinks a grid's features beyond one tile's worth (its interpolation runs)

TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=TILE,
              patch_size=PATCH)


def tiny_config(family: str) -> Any:
    if family == "llava_next":  # CLIP (a CLS token, dropped: "default"), the last-but-one layer's states
        from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig

        return LlavaNextConfig(vision_config=CLIPVisionConfig(projection_dim=32, **VISION),
                               text_config=LlamaConfig(**TEXT), image_token_id=IMAGE,
                               image_grid_pinpoints=PINPOINTS_NEXT, projector_hidden_act="gelu")
    if family == "llava_onevision":  # SigLIP (no CLS: "full"), the last layer's states
        from transformers import LlavaOnevisionConfig, Qwen2Config, SiglipVisionConfig

        siglip = SiglipVisionConfig(vision_use_head=False, **VISION)  # as the family's checkpoints (and defaults)
        return LlavaOnevisionConfig(vision_config=siglip, text_config=Qwen2Config(**TEXT),
                                    image_token_id=IMAGE, video_token_id=VIDEO, image_grid_pinpoints=PINPOINTS,
                                    vision_feature_select_strategy="full", vision_feature_layer=-1,
                                    vision_aspect_ratio=ASPECT, projector_hidden_act="gelu")
    raise ValueError(family)


def build_model(family: str) -> torch.nn.Module:
    from transformers import LlavaNextForConditionalGeneration, LlavaOnevisionForConditionalGeneration

    torch.manual_seed(SEED)
    cls = {"llava_next": LlavaNextForConditionalGeneration,
           "llava_onevision": LlavaOnevisionForConditionalGeneration}[family]
    model = cls(tiny_config(family))
    model.config._attn_implementation = "sdpa"  # also the sub-configs
    return model


def image_processor(family: str) -> Any:
    if family == "llava_next":
        from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

        return LlavaNextImageProcessorPil(image_grid_pinpoints=PINPOINTS_NEXT, size={"shortest_edge": TILE},
                                          crop_size={"height": TILE, "width": TILE})
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    return LlavaOnevisionImageProcessorPil(image_grid_pinpoints=PINPOINTS, size={"height": TILE, "width": TILE})


def placeholder_counter(family: str) -> Any:
    """The family's processor, for its own count of placeholders per image and video (see the module docstring)."""
    from transformers import LlavaNextProcessor, LlavaOnevisionProcessor

    if family == "llava_next":
        counter = LlavaNextProcessor.__new__(LlavaNextProcessor)
        counter.patch_size, counter.num_additional_image_tokens = PATCH, 1  # CLIP's CLS
        counter.vision_feature_select_strategy = "default"
    else:
        counter = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
        counter.num_image_tokens, counter.vision_aspect_ratio = (TILE // PATCH) ** 2, ASPECT
        counter.vision_feature_select_strategy, counter.video_token = "full", "<video>"
    counter.image_processor, counter.image_token = image_processor(family), "<image>"
    return counter


def _picture(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    return (rng.random((height, width, 3)) * 255).astype(np.uint8)


def batch(family: str, rng: np.random.Generator, rows: list[list[Any]]) -> dict[str, torch.Tensor]:
    """One batch, right-padded. Each row is a list of parts: an ``int`` is that many text tokens, ``("image", h, w)``
    an image, ``("video", frames, h, w)`` a video; all images of the batch go through the image processor in one call
    (one list per row with images, as the processor takes a batch)."""
    processor, counter = image_processor(family), placeholder_counter(family)
    pictures = [[_picture(rng, *part[1:]) for part in row if isinstance(part, tuple) and part[0] == "image"]
                for row in rows]
    given = [p for p in pictures if p] if family == "llava_onevision" else [p for row in pictures for p in row]
    images = processor(images=given, return_tensors="pt") if given else None
    videos, ids, image = [], [], 0
    for row in rows:
        tokens = []
        for part in row:
            if isinstance(part, int):
                tokens += _text(rng, part)
            elif part[0] == "image":
                tokens += [IMAGE] * (len(counter.replace_image_token(images, image)) // len("<image>"))
                image += 1
            else:
                frames = processor(images=[_picture(rng, *part[2:]) for _ in range(part[1])], return_tensors="pt")
                videos.append(frames["pixel_values"][:, 0])  # [frames, C, 16, 16]: each frame's base tile
                video = {"pixel_values_videos": videos[-1:]}
                tokens += [VIDEO] * (len(counter.replace_video_token(video, 0)) // len("<video>"))
        ids.append(torch.tensor(tokens))
    length = max(len(row) for row in ids)
    input_ids = torch.zeros(len(ids), length, dtype=torch.long)
    mask = torch.zeros(len(ids), length, dtype=torch.long)
    for k, row in enumerate(ids):
        input_ids[k, :len(row)], mask[k, :len(row)] = row, 1
    out = {"input_ids": input_ids, "labels": input_ids.masked_fill((mask == 0) | (input_ids >= 100), -100)}
    if not bool(mask.all()):
        out["attention_mask"] = mask
    if images is not None:
        out.update({key: images[key] for key in ("pixel_values", "image_sizes", "batch_num_images") if key in images})
    if videos:
        out["pixel_values_videos"] = torch.stack(videos)  # [videos, frames, C, 16, 16]
    return out


def batches(family: str) -> list[dict[str, torch.Tensor]]:
    """(a) one image whose placeholders straddle the middle of the row (sp=2's boundary); (b) two images of different
    sizes and tile counts (LLaVA-NeXT: in one row; OneVision: one per row, as a row with several takes base tiles
    only); (c) LLaVA-NeXT: three images, wide, tall and small; OneVision: an image and a video of 3 frames; (d) two
    rows right-padded, one text-only (OneVision: the other a row with two images, base tiles only)."""
    rng = np.random.default_rng(17)
    wide, tall, small, square = ("image", 20, 30), ("image", 40, 22), ("image", 12, 12), ("image", 30, 30)
    if family == "llava_next":
        return [batch(family, rng, [[12, wide, 40]]),
                batch(family, rng, [[3, wide, 2, small, 5]]),
                batch(family, rng, [[4, wide, 2, tall, 3, small, 4]]),
                batch(family, rng, [[5, square, 7], [13]])]
    return [batch(family, rng, [[9, square, 20]]),
            batch(family, rng, [[3, wide, 5], [4, small, 2]]),
            batch(family, rng, [[4, tall, 3, ("video", 3, 16, 20), 4]]),
            batch(family, rng, [[5, wide, 2, small, 7], [13]])]


def selected_batches(select: Optional[list[int]] = None, family: str = "llava_next") -> list[dict[str, torch.Tensor]]:
    every = batches(family)
    return every if select is None else [every[i] for i in select]
