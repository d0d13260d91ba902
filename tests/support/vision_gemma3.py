"""A tiny Gemma 3 (SigLIP tower, one sliding-window layer with a window of 8 and one full-attention layer) and its
batches the way users get them: images of any size through Gemma 3's own image processor (PIL backend, built
locally), each image as ``<boi>`` + ``mm_tokens_per_image`` placeholders + ``<eoi>`` in the text, the processor's
``token_type_ids`` (1 on placeholders, which makes each image's tokens attend to each other both ways), labels
``-100`` on the image tokens and the padding."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from tests.support.vision import IMAGE, SEED, _text, collate

BOI, EOI = 122, 123
IMAGE_SIZE, PATCH = 16, 4  # 16 patches per image
TOKENS = 16  # mm_tokens_per_image: the pool keeps all 4 × 4 patches
WINDOW = 8  # the sliding layer's window, shorter than an image block


def tiny_config() -> Any:
    from transformers import Gemma3Config

    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, max_position_embeddings=512,
                sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH,
                  vision_use_head=False)  # as Gemma 3's checkpoints: no attention-pooling head
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS, image_token_index=IMAGE,
                        boi_token_index=BOI, eoi_token_index=EOI)


def build_model(family: str = "gemma3") -> torch.nn.Module:
    from transformers import Gemma3ForConditionalGeneration

    if family != "gemma3":
        raise ValueError(family)
    torch.manual_seed(SEED)
    model = Gemma3ForConditionalGeneration(tiny_config())
    model.config._attn_implementation = "sdpa"  # also the sub-configs
    return model


def image_processor() -> Any:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False)


def image(rng: np.random.Generator, height: int, width: int) -> tuple[list[int], torch.Tensor]:
    """One image of ``height × width`` random pixels: its tokens ``<boi>`` placeholders ``<eoi>`` and its pixels
    ``[1, 3, 16, 16]`` (resized by the processor)."""
    pixels = (rng.random((height, width, 3)) * 255).astype(np.uint8)
    return [BOI] + [IMAGE] * TOKENS + [EOI], image_processor()(images=[pixels], return_tensors="pt")["pixel_values"]


def sample(rng: np.random.Generator, pieces: list[Any]) -> dict[str, Any]:
    """One sample from ``pieces``: an int is that many text tokens, a ``(height, width)`` pair an image."""
    ids, pixels = [], []
    for piece in pieces:
        if isinstance(piece, int):
            ids += _text(rng, piece)
        else:
            tokens, image_pixels = image(rng, *piece)
            ids += tokens
            pixels.append(image_pixels)
    out = {"input_ids": torch.tensor(ids)}
    if pixels:
        out["pixel_values"] = torch.cat(pixels)  # [images, 3, 16, 16]
    return out


def gemma3_collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-padded rows as :func:`tests.support.vision.collate`, the token types under the name Gemma 3's
    processor gives them (``token_type_ids``)."""
    batch = collate(samples)
    batch["token_type_ids"] = batch.pop("mm_token_type_ids").long()
    return batch


def batches() -> list[dict[str, torch.Tensor]]:
    """(a) one image whose 16 placeholders straddle the middle of the row (the boundary of sp=2), (b) two images of
    different sizes, (c) images at both ends of the row (the first placeholder at position 1, the last image's
    ``<eoi>`` the row's last token), (d) two rows, one text-only, right-padded."""
    rng = np.random.default_rng(5)
    one = sample(rng, [11, (20, 28), 9])  # placeholders 12..27 of 38
    two = sample(rng, [3, (16, 16), 3, (40, 24), 5])
    ends = sample(rng, [(16, 16), 7, (24, 24)])
    padded_pair = [sample(rng, [5, (16, 16), 7]), {"input_ids": torch.from_numpy(rng.integers(0, 100, 13))}]
    return [gemma3_collate([one]), gemma3_collate([two]), gemma3_collate([ends]), gemma3_collate(padded_pair)]


def selected_batches(select: Optional[list[int]] = None, family: str = "gemma3") -> list[dict[str, torch.Tensor]]:
    every = batches()
    return every if select is None else [every[i] for i in select]
