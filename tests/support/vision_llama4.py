"""A tiny Llama 4 vision-language model built from a config, and batches laid out the way its processor lays them
out (``Llama4Processor._prompt_split_image``): an image of ``h × w`` tiles is ``<|image_start|>``, per tile its
``<|patch|>`` placeholders (4 feature rows per 16-pixel tile after the pixel shuffle) with x/y tile separators, then
``<|image|>`` and the placeholders of the global (thumbnail) tile, ``<|image_end|>``; ``pixel_values`` ``[tiles, 3,
16, 16]`` (the tiles, then the global tile). The text model has chunked attention (chunks of 8 tokens) and a NoPE
layer with attention-temperature tuning, as Llama 4 Scout has."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from tests.support.vision import SEED, _text, collate

IMAGE, START, END, TILE_X, TILE_Y, GLOBAL = 120, 121, 122, 123, 124, 125  # text tokens are < 100
TILE, PATCH = 16, 4
ROWS_PER_TILE = (TILE // PATCH) ** 2 // 4  # feature rows per tile after the pixel shuffle (ratio 0.5)
FAMILIES = ("llama4",)


def tiny_config(family: str = "llama4") -> Any:
    from transformers import Llama4Config

    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=8,
                no_rope_layers=[1, 0], floor_scale=4, attn_temperature_tuning=True, pad_token_id=0)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                  image_size=TILE, patch_size=PATCH, vision_output_dim=32, projector_input_dim=32,
                  projector_output_dim=32, pixel_shuffle_ratio=0.5)
    return Llama4Config(text_config=text, vision_config=vision, image_token_index=IMAGE)


def build_model(family: str = "llama4") -> torch.nn.Module:
    from transformers import Llama4ForConditionalGeneration

    torch.manual_seed(SEED)
    model = Llama4ForConditionalGeneration(tiny_config(family))
    model.config._attn_implementation = "sdpa"  # also the sub-configs
    # transformers 5.24's Llama4ForConditionalGeneration.forward reads `outputs.image_outputs` from its language
    # model's output, which has no such field: every call raises AttributeError, on one device too. The tests give
    # that output the field (None, what the forward would pass on), so that the rest of the model runs as written.
    model.language_model.register_forward_hook(_with_image_outputs_field)
    return model


def _with_image_outputs_field(module: torch.nn.Module, args: Any, output: Any) -> Any:
    if not isinstance(output, tuple) and not hasattr(output, "image_outputs"):
        object.__setattr__(output, "image_outputs", None)
    return output


def image_tokens(ratio_h: int, ratio_w: int) -> list[int]:
    """The placeholder layout of one image of ``ratio_h × ratio_w`` tiles (plus its global tile when it has several)."""
    ids = [START]
    if ratio_h * ratio_w > 1:
        for _ in range(ratio_h):
            for x in range(ratio_w):
                ids += [IMAGE] * ROWS_PER_TILE + ([TILE_X] if x < ratio_w - 1 else [])
            ids.append(TILE_Y)
    return ids + [GLOBAL] + [IMAGE] * ROWS_PER_TILE + [END]


def one_sample(rng: np.random.Generator, before: int, images: list[tuple[int, int]] = (),
               after: int = 6) -> dict[str, Any]:
    ids, tiles = _text(rng, before), 0
    for ratio_h, ratio_w in images:
        ids += image_tokens(ratio_h, ratio_w) + _text(rng, 2)
        tiles += ratio_h * ratio_w + (1 if ratio_h * ratio_w > 1 else 0)
    out = {"input_ids": torch.tensor(ids + _text(rng, after))}
    if tiles:
        out["pixel_values"] = torch.from_numpy(rng.standard_normal((tiles, 3, TILE, TILE))).float()
    return out


def llama4_batches() -> list[dict[str, torch.Tensor]]:
    """(a) one 2 × 2-tile image (5 tiles, 20 feature rows) straddling the middle of the row, (b) a one-tile image and
    a 1 × 2-tile image, (c) two rows, one text-only, right-padded, (d) text only, longer than two chunks."""
    rng = np.random.default_rng(17)
    return [collate([one_sample(rng, 6, [(2, 2)], 7)]), collate([one_sample(rng, 3, [(1, 1), (1, 2)], 4)]),
            collate([one_sample(rng, 5, [(1, 1)], 6), one_sample(rng, 12)]), collate([one_sample(rng, 30)])]


def selected_batches(select: Optional[list[int]] = None, family: str = "llama4") -> list[dict[str, torch.Tensor]]:
    every = llama4_batches()
    return every if select is None else [every[i] for i in select]
