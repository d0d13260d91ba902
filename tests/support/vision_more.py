"""Tiny InternVL and Mistral 3 models built from configs, and batches the way users get them: pixels from the
family's own image processor (PIL backend, built locally from arguments), placeholder tokens laid out as the
family's processor lays them out, labels ``-100`` on vision tokens and padding.

* InternVL: images cut into 16-pixel tiles (``crop_to_patches``, a thumbnail tile added), ``<img>`` + 4 context
  tokens per tile + ``</img>``; a video's frames are one tile each (``Frame1: <img>...</img>``), as its processor
  does.
* Mistral 3: images resized to multiples of 8 pixels (patch 4 × merge 2), padded to the batch's largest,
  ``image_sizes``; per image ``w`` placeholders + a break token per feature row, the last break an end token.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from tests.support.vision import SEED, _text, collate

IMAGE, BREAK, START, END = 120, 121, 122, 123  # special token ids of the tiny configs (text tokens are < 100)
PATCH = 4
TILE = 16  # InternVL: pixels per side of a tile
TILE_ROWS = (TILE // PATCH) ** 2 // 4  # feature rows per tile after the pixel shuffle (downsample ratio 0.5)
MERGE = 2  # Mistral 3: spatial merge
LONGEST = 32  # Mistral 3: longest edge in pixels after resizing
FAMILIES = ("internvl", "mistral3")

_TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def tiny_config(family: str) -> Any:
    if family == "internvl":
        from transformers import InternVLConfig

        vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                      image_size=TILE, patch_size=PATCH)
        return InternVLConfig(vision_config=vision, text_config=dict(_TEXT, model_type="qwen2"),
                              image_token_id=IMAGE, image_seq_length=TILE_ROWS)
    if family == "mistral3":
        from transformers import Mistral3Config

        vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, patch_size=PATCH, image_size=LONGEST)
        text = dict(_TEXT, model_type="mistral", sliding_window=None, head_dim=8)
        return Mistral3Config(vision_config=vision, text_config=text, image_token_index=IMAGE,
                              spatial_merge_size=MERGE)
    raise ValueError(family)


def build_model(family: str) -> torch.nn.Module:
    from transformers import InternVLForConditionalGeneration, Mistral3ForConditionalGeneration

    torch.manual_seed(SEED)
    cls = {"internvl": InternVLForConditionalGeneration, "mistral3": Mistral3ForConditionalGeneration}[family]
    model = cls(tiny_config(family))
    model.config._attn_implementation = "sdpa"  # also the sub-configs
    return model


def _image(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    return (rng.random((height, width, 3)) * 255).astype(np.uint8)


def _internvl_processor():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil(size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1,
                                    max_patches=4)


def _mistral3_processor():
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    return PixtralImageProcessorPil(patch_size=PATCH * MERGE, size={"longest_edge": LONGEST})


def internvl_sample(rng: np.random.Generator, before: int, images: list[tuple[int, int]] = (), after: int = 6,
                    frames: int = 0, between: int = 3) -> dict[str, Any]:
    """``before`` text tokens, each image (height, width in pixels) as ``<img>`` + its tiles' placeholders +
    ``</img>`` and ``between`` text tokens, an optional video of ``frames`` frames (one tile each), ``after`` text
    tokens; ``pixel_values [tiles, 3, 16, 16]`` in placeholder order."""
    ids, tiles = _text(rng, before), []
    if images:
        out = _internvl_processor()(images=[_image(rng, h, w) for h, w in images], return_tensors="pt")
        tiles.append(out["pixel_values"])
        for count in out["num_patches"].tolist():
            ids += [START] + [IMAGE] * TILE_ROWS * int(count) + [END] + _text(rng, between)
    if frames:
        processor = _internvl_processor()
        video = [_image(rng, TILE, TILE) for _ in range(frames)]
        tiles.append(processor(images=video, crop_to_patches=False, return_tensors="pt")["pixel_values"])
        for _ in range(frames):
            ids += _text(rng, 2) + [START] + [IMAGE] * TILE_ROWS + [END]
    out = {"input_ids": torch.tensor(ids + _text(rng, after))}
    if tiles:
        out["pixel_values"] = torch.cat(tiles)
    return out


def mistral3_batch(rng: np.random.Generator, rows: list[tuple[int, list[tuple[int, int]], int]],
                   between: int = 3) -> dict[str, torch.Tensor]:
    """Rows of (text before, image sizes in pixels, text after); all images of the batch through the processor in
    one call (padded to the largest, ``image_sizes``), as the family's processor does for a batch."""
    images = [_image(rng, h, w) for _, sizes, _ in rows for h, w in sizes]
    processed = _mistral3_processor()(images=images, return_tensors="pt") if images else None
    sizes = processed["image_sizes"].tolist() if processed is not None else []
    side = PATCH * MERGE
    samples, next_image = [], 0
    for before, row_sizes, after in rows:
        ids = _text(rng, before)
        for _ in row_sizes:
            height, width = sizes[next_image]
            next_image += 1
            tokens = ([IMAGE] * (width // side) + [BREAK]) * (height // side)
            ids += tokens[:-1] + [END] + _text(rng, between)
        samples.append({"input_ids": torch.tensor(ids + _text(rng, after))})
    batch = collate(samples)
    batch.pop("mm_token_type_ids")
    if processed is not None:
        batch["pixel_values"], batch["image_sizes"] = processed["pixel_values"], processed["image_sizes"]
    return batch


def internvl_batches() -> list[dict[str, torch.Tensor]]:
    """(a) one wide image (4 tiles + thumbnail) straddling the middle of the row, (b) images of different sizes
    (different tile counts) and a 2-frame video, (c) two rows, one text-only, right-padded, (d) two rows with images
    in both."""
    rng = np.random.default_rng(3)

    def one(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = collate(samples)
        batch.pop("mm_token_type_ids")
        return batch

    straddling = internvl_sample(rng, before=9, images=[(16, 64)], after=7)
    several = internvl_sample(rng, before=3, images=[(16, 16), (32, 16), (20, 44)], frames=2, after=4)
    text_only = {"input_ids": torch.from_numpy(rng.integers(0, 100, 15))}
    padded = [internvl_sample(rng, before=5, images=[(24, 16)], after=6), text_only]
    both = [internvl_sample(rng, before=4, images=[(16, 16)], after=5),
            internvl_sample(rng, before=2, images=[(16, 40)], after=3)]
    return [one([straddling]), one([several]), one(padded), one(both)]


def mistral3_batches() -> list[dict[str, torch.Tensor]]:
    """(a) one image (3 × 4 feature rows) straddling the middle of the row, (b) three images of different sizes,
    (c) two rows, one text-only, right-padded, (d) two rows with images of different sizes in both."""
    rng = np.random.default_rng(5)
    return [mistral3_batch(rng, [(10, [(24, 32)], 8)]),
            mistral3_batch(rng, [(3, [(16, 24), (32, 16), (8, 8)], 4)]),
            mistral3_batch(rng, [(5, [(16, 16)], 7), (14, [], 0)]),
            mistral3_batch(rng, [(4, [(8, 24)], 5), (2, [(32, 32)], 3)])]


def selected_batches(select: Optional[list[int]] = None, family: str = "internvl") -> list[dict[str, torch.Tensor]]:
    every = internvl_batches() if family == "internvl" else mistral3_batches()
    return every if select is None else [every[i] for i in select]
