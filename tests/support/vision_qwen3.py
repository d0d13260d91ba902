"""Tiny Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE models built from configs (hidden 32, 2 layers; Qwen3-VL's
deepstack taps both vision layers into both decoder layers; Qwen3.5's decoder is one gated-delta-net layer and one
attention layer; MoE: 4 experts, top 2, router loss on), and their batches the way users get them.

Images go through the families' image processor (Qwen2-VL's, PIL backend, built locally). Videos go through
Qwen3-VL's own video processor for its patch layout and grid (frames given already normalized: its resize, rescale
and normalize steps need torchvision, which is not installed), and their tokens are written as Qwen3-VL's processor
writes them: per temporal patch ``<timestamp text> <vision_start> placeholders <vision_end>`` (the timestamp text one
token per character here, as there is no tokenizer).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from tests.support.vision import (END, IMAGE, MERGE, PATCH, SEED, START, TEMPORAL, VIDEO, _image_processor, _text,
                                  collate, pack)

FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
FPS = 2.0  # the tiny videos' frame rate (their timestamps)

TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
# interleaved M-RoPE over 4 frequencies (head_dim 16, half of it rotated in Qwen3.5: partial rotary): T, H, W, T
ROPE = {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True, "rope_theta": 10000.0}
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=PATCH,
              spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, in_channels=3, out_hidden_size=32,
              num_position_embeddings=16)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True,
           router_aux_loss_coef=0.5)
GATED_DELTA = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)


def tiny_config(family: str) -> Any:
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

        text = dict(TEXT, rope_parameters=ROPE, **(MOE if family == "qwen3_vl_moe" else {}))
        cls = Qwen3VLConfig if family == "qwen3_vl" else Qwen3VLMoeConfig
        return cls(text_config=text, vision_config=dict(VISION, deepstack_visual_indexes=[0, 1]), **TOKENS)
    if family in ("qwen3_5", "qwen3_5_moe"):
        from transformers import Qwen3_5Config, Qwen3_5MoeConfig

        rope = dict(ROPE, partial_rotary_factor=0.5)
        moe = dict(MOE, shared_expert_intermediate_size=32) if family == "qwen3_5_moe" else {}
        text = dict(TEXT, rope_parameters=rope, **GATED_DELTA, **moe)
        cls = Qwen3_5Config if family == "qwen3_5" else Qwen3_5MoeConfig
        return cls(text_config=text, vision_config=VISION, **TOKENS)
    raise ValueError(family)


def build_model(family: str) -> torch.nn.Module:
    from transformers import (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration,
                              Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration)

    torch.manual_seed(SEED)
    cls = {"qwen3_vl": Qwen3VLForConditionalGeneration, "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration,
           "qwen3_5": Qwen3_5ForConditionalGeneration, "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration}[family]
    model = cls(tiny_config(family))
    model.config._attn_implementation = "sdpa"  # also the sub-configs
    return model


def _video_processor():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                 do_convert_rgb=False, do_resize=False, do_rescale=False, do_normalize=False,
                                 cap_pixels_per_frame=False)


def _video(rng: np.random.Generator, frames: int, height: int, width: int) -> tuple[list[int], dict[str, Any]]:
    """The video's tokens as Qwen3-VL's processor writes them and its processor outputs."""
    clip = rng.standard_normal((frames, height, width, 3)).astype(np.float32)  # normalized frames
    out = _video_processor()(videos=[clip], return_tensors="pt", do_sample_frames=False, return_metadata=True)
    t, h, w = out["video_grid_thw"][0].tolist()
    indices = out["video_metadata"][0].frames_indices
    ids = []
    for patch in range(t):  # one timestamp per temporal patch: the mean time of its frames
        frame_times = [i / FPS for i in indices[patch * TEMPORAL:(patch + 1) * TEMPORAL]]
        stamp = f"<{(frame_times[0] + frame_times[-1]) / 2:.1f} seconds>"
        ids += [ord(c) % 100 for c in stamp] + [START] + [VIDEO] * (h * w // MERGE ** 2) + [END]
    return ids, {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": out["video_grid_thw"]}


def sample(rng: np.random.Generator, before: int, images: list[tuple[int, int]] = (), after: int = 6,
           video: Optional[tuple[int, int, int]] = None, between: int = 3) -> dict[str, Any]:
    """``before`` text tokens, each image (height, width in pixels) as <start> placeholders <end> and ``between``
    text tokens, an optional video (frames, height, width) and ``between`` text tokens, ``after`` text tokens."""
    ids = _text(rng, before)
    pixels, grids, out = [], [], {}
    processor = _image_processor()
    for height, width in images:
        image = (rng.random((height, width, 3)) * 255).astype(np.uint8)
        processed = processor(images=[image], return_tensors="pt")
        pixels.append(processed["pixel_values"])
        grids.append(processed["image_grid_thw"])
        ids += [START] + [IMAGE] * int(processed["image_grid_thw"].prod() // MERGE ** 2) + [END] + _text(rng, between)
    if video is not None:
        video_ids, video_inputs = _video(rng, *video)
        ids += video_ids + _text(rng, between)
        out.update(video_inputs)
    if pixels:
        out["pixel_values"], out["image_grid_thw"] = torch.cat(pixels), torch.cat(grids)
    out["input_ids"] = torch.tensor(ids + _text(rng, after))
    return out


def batches() -> list[dict[str, torch.Tensor]]:
    """(a) one image whose placeholders straddle the middle of the row (sp=2's boundary), (b) two images of
    different sizes, (c) an image then a video of two temporal patches (timestamps between them), (d) two rows, one
    text-only, right-padded."""
    rng = np.random.default_rng(17)
    one = sample(rng, before=11, images=[(16, 24)], after=9)  # 6 placeholders from position 12 of 30
    several = sample(rng, before=3, images=[(16, 16), (24, 16)], after=5)
    video = sample(rng, before=4, images=[(8, 8)], video=(4, 16, 24), after=4)
    text_only = {"input_ids": torch.from_numpy(rng.integers(0, 100, 13))}
    padded_pair = [sample(rng, before=5, images=[(16, 16)], after=7), text_only]
    return [collate([one]), collate([several]), collate([video]), collate(padded_pair)]


def packed_batches(family: str, separate: bool = False) -> list[dict[str, torch.Tensor]]:
    """(e) a row packing an image sample, a text-only sample and an image-and-video sample, with the ``[4, 1, S]``
    positions a user gives one device (:func:`tests.support.vision.pack`); (f) two of them in the other order.
    ``separate``: the same samples as right-padded rows, the reference (no sample attends to another)."""
    rng = np.random.default_rng(19)
    first = sample(rng, before=6, images=[(16, 24)], after=3)
    second = {"input_ids": torch.from_numpy(rng.integers(0, 100, 9))}
    third = sample(rng, before=2, images=[(8, 8)], video=(4, 16, 16), after=2)
    if separate:
        return [collate([first, second, third]), collate([third, first])]
    inner = build_model(family).model
    with torch.no_grad():
        return [pack([first, second, third], family, inner), pack([third, first], family, inner)]


def selected_batches(select: Optional[list[int]] = None, family: str = "qwen3_vl",
                     reference: bool = False) -> list[dict[str, torch.Tensor]]:
    """Batches (a)-(d), or those ``select`` names: 4 and 5 are the packed rows (for the ``reference``: their samples
    as separate rows)."""
    every = batches()
    if select is None:
        return every
    every = every + (packed_batches(family, separate=reference) if any(i >= len(every) for i in select) else [])
    return [every[i] for i in select]
