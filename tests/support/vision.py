"""Tiny vision-language models (Qwen2-VL, Qwen2.5-VL) built from configs, and batches with images and videos the way
users get them: images through the model's own image processor (its PIL backend, built locally), placeholder tokens
in the text, ``image_grid_thw`` / ``video_grid_thw``, ``mm_token_type_ids``, labels ``-100`` on placeholders."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, Dataset

IMAGE, VIDEO, START, END = 120, 121, 122, 123  # special token ids of the tiny configs (text tokens are < 100)
PATCH, MERGE, TEMPORAL = 4, 2, 2  # patch size, spatial merge, temporal patch size
SEED = 0


def tiny_config(family: str) -> Any:
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0})
    vision = dict(depth=2, hidden_size=32, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
                  temporal_patch_size=TEMPORAL, in_channels=3)
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig

        return Qwen2VLConfig(text_config=text, vision_config=dict(vision, embed_dim=16, mlp_ratio=2), **tokens)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        return Qwen2_5_VLConfig(text_config=text, vision_config=dict(vision, intermediate_size=48, out_hidden_size=32,
                                                                     window_size=16, fullatt_block_indexes=[1]),
                                **tokens)
    if family == "llava":
        from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

        clip = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=LLAVA_IMAGE, patch_size=PATCH, projection_dim=32)
        llama = LlamaConfig(**{k: v for k, v in text.items() if k != "rope_parameters"})
        return LlavaConfig(vision_config=clip, text_config=llama, image_token_id=IMAGE,
                           image_seq_length=LLAVA_TOKENS, projector_hidden_act="gelu")
    raise ValueError(family)


LLAVA_IMAGE = 16  # pixels per side of a LLaVA image: (16 / 4)^2 = 16 patches, 16 feature rows (CLS dropped)
LLAVA_TOKENS = (LLAVA_IMAGE // PATCH) ** 2


def build_model(family: str) -> torch.nn.Module:
    from transformers import (LlavaForConditionalGeneration, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLForConditionalGeneration)

    torch.manual_seed(SEED)
    cls = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
           "llava": LlavaForConditionalGeneration}[family]
    model = cls(tiny_config(family))
    model.config._attn_implementation = "sdpa"  # also the sub-configs
    return model


def _image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                    min_pixels=8 * 8, max_pixels=64 * 64)


def _text(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 100, n).tolist()


def sample(rng: np.random.Generator, before: int, images: list[tuple[int, int]] = (), after: int = 6,
           video: Optional[tuple[int, int, int]] = None, between: int = 3) -> dict[str, Any]:
    """One sample: ``before`` text tokens, each image (height, width in pixels) as <start> placeholders <end> with
    ``between`` text tokens after it, an optional video (frames, height, width; random pixels in the processor's
    patch layout), ``after`` text tokens."""
    ids = _text(rng, before)
    pixels, grids, video_pixels, video_grids = [], [], [], []
    processor = _image_processor()
    for height, width in images:
        image = (rng.random((height, width, 3)) * 255).astype(np.uint8)
        out = processor(images=[image], return_tensors="pt")
        pixels.append(out["pixel_values"])
        grids.append(out["image_grid_thw"])
        ids += [START] + [IMAGE] * int(out["image_grid_thw"].prod() // MERGE ** 2) + [END] + _text(rng, between)
    if video is not None:
        frames, height, width = video
        grid = torch.tensor([[frames // TEMPORAL, height // PATCH, width // PATCH]])
        video_pixels.append(torch.from_numpy(rng.standard_normal((int(grid.prod()), 3 * TEMPORAL * PATCH * PATCH))
                                             ).float())
        video_grids.append(grid)
        ids += [START] + [VIDEO] * int(grid.prod() // MERGE ** 2) + [END] + _text(rng, between)
    ids += _text(rng, after)
    out = {"input_ids": torch.tensor(ids)}
    if pixels:
        out["pixel_values"], out["image_grid_thw"] = torch.cat(pixels), torch.cat(grids)
    if video_pixels:
        out["pixel_values_videos"], out["video_grid_thw"] = torch.cat(video_pixels), torch.cat(video_grids)
    return out


def collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Rows right-padded to the longest, the vision tensors of all samples concatenated in row order."""
    length = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, :len(s["input_ids"])] = s["input_ids"]
        mask[row, :len(s["input_ids"])] = 1
    labels = ids.masked_fill((mask == 0) | (ids >= 100), -100)  # no loss on padding and vision tokens
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == IMAGE], types[ids == VIDEO] = 1, 2
    batch = {"input_ids": ids, "labels": labels, "mm_token_type_ids": types}
    if not bool(mask.all()):
        batch["attention_mask"] = mask
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        parts = [s[key] for s in samples if key in s]  # row order: the order of the placeholders
        if parts:
            batch[key] = torch.cat(parts)
    return batch


def batches() -> list[dict[str, torch.Tensor]]:
    """The four batches of the parity runs: (a) one image whose placeholders straddle the middle of the row (the
    boundary of sp=2), (b) two images of different sizes, (c) a video after an image, (d) two rows, one text-only,
    right-padded."""
    rng = np.random.default_rng(7)
    one = sample(rng, before=11, images=[(16, 24)], after=9)  # 6 placeholders from position 12
    several = sample(rng, before=3, images=[(16, 16), (24, 16)], after=5)
    video = sample(rng, before=4, images=[(8, 8)], video=(4, 16, 16), after=4)
    text_only = {"input_ids": torch.from_numpy(rng.integers(0, 100, 13))}
    padded_pair = [sample(rng, before=5, images=[(16, 16)], after=7), text_only]
    return [collate([one]), collate([several]), collate([video]), collate(padded_pair)]


def pack(samples: list[dict[str, Any]], family: str, inner: Optional[torch.nn.Module] = None) -> dict[str, torch.Tensor]:
    """One row packing ``samples`` the way a user packs for a Qwen-VL model on one device: ``position_ids`` ``[4, 1,
    S]`` (text positions restarting per sample, then each sample's M-RoPE rows from the model's own
    ``get_rope_index``), labels ``-100`` on each sample's first token (no sample predicts the next one's start), the
    vision tensors of all samples in order. LLaVA (1-D positions): ``position_ids`` ``[1, S]`` restarting."""
    ids = torch.cat([s["input_ids"] for s in samples])[None]  # [1, S]
    text = torch.cat([torch.arange(len(s["input_ids"])) for s in samples])[None]  # [1, S]
    batch = collate([{**s, "input_ids": ids[0]} for s in samples[:1]])  # labels and token types of the whole row
    batch["labels"][0, text[0] == 0] = -100
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        parts = [s[key] for s in samples if key in s]
        if parts:
            batch[key] = torch.cat(parts)
    if family == "llava":
        batch["position_ids"] = text
        return batch
    inner = inner if inner is not None else build_model(family).model
    rope = [inner.get_rope_index(s["input_ids"][None], collate([s])["mm_token_type_ids"],
                                 image_grid_thw=s.get("image_grid_thw"), video_grid_thw=s.get("video_grid_thw"))[0]
            for s in samples]  # [3, 1, S_i] each
    batch["position_ids"] = torch.cat([text[None], torch.cat(rope, dim=2)])  # [4, 1, S]
    return batch


def packed_batches(family: str, separate: bool = False) -> list[dict[str, torch.Tensor]]:
    """(e) and (f): rows packing an image sample, a text-only sample and a sample with an image and a video (Qwen-VL),
    or image and text-only samples (LLaVA); the second packs the samples in another order. ``separate``: the same
    samples as right-padded rows of one batch, the single-device reference of packing's promise (no sample attends
    to another; plain transformers on ``sdpa`` does not keep packed samples apart)."""
    rng = np.random.default_rng(13)
    if family == "llava":
        def one(before: int, images: int) -> dict[str, Any]:
            ids = _text(rng, before) + ([IMAGE] * LLAVA_TOKENS + _text(rng, 3)) * images
            out = {"input_ids": torch.tensor(ids)}
            if images:
                out["pixel_values"] = torch.from_numpy(
                    rng.standard_normal((images, 3, LLAVA_IMAGE, LLAVA_IMAGE))).float()
            return out

        first, second, third = one(7, 1), one(9, 0), one(4, 2)
    else:
        first = sample(rng, before=6, images=[(16, 24)], after=3)
        second = {"input_ids": torch.from_numpy(rng.integers(0, 100, 9))}
        third = sample(rng, before=2, images=[(8, 8)], video=(4, 16, 16), after=2)
    if separate:
        return [collate([first, second, third]), collate([third, first])]
    with torch.no_grad():
        return [pack([first, second, third], family), pack([third, first], family)]


def llava_batches() -> list[dict[str, torch.Tensor]]:
    """LLaVA's batches (fixed-size images, ``pixel_values`` ``[images, 3, H, W]``, 16 placeholders each): (a) one
    image straddling the middle of the row, (b) three images, (c) two rows, one text-only, right-padded, (d) text
    only."""
    rng = np.random.default_rng(11)

    def one(before: int, images: int, after: int) -> dict[str, Any]:
        ids = _text(rng, before)
        for _ in range(images):
            ids += [IMAGE] * LLAVA_TOKENS + _text(rng, 2)
        out = {"input_ids": torch.tensor(ids + _text(rng, after))}
        if images:
            out["pixel_values"] = torch.from_numpy(rng.standard_normal((images, 3, LLAVA_IMAGE, LLAVA_IMAGE))).float()
        return out

    return [collate([one(9, 1, 9)]), collate([one(3, 3, 4)]), collate([one(5, 1, 6), one(12, 0, 0)]),
            collate([one(30, 0, 0)])]


def selected_batches(select: Optional[list[int]] = None, family: str = "qwen2_vl",
                     reference: bool = False) -> list[dict[str, torch.Tensor]]:
    """The family's batches (a)-(d), or those ``select`` names: 4 and 5 are the packed rows (e) and (f) (for the
    ``reference``: their samples as separate rows)."""
    every = llava_batches() if family == "llava" else batches()
    if select is None:
        return every
    every = every + (packed_batches(family, separate=reference) if any(i >= len(every) for i in select) else [])
    return [every[i] for i in select]


class BatchList(Dataset):
    def __init__(self, items: list[dict[str, torch.Tensor]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


def _first(items: list[Any]) -> Any:
    return items[0]


def family_support(support: Optional[str] = None) -> Any:
    """The test-support module that builds a family's tiny model and its batches (``build_model(family)``,
    ``selected_batches(select, family)``): this one by default, or e.g. ``"tests.support.vision_qwen3"``."""
    import importlib
    import sys

    return importlib.import_module(support) if support else sys.modules[__name__]


class VisionLanguageLM(LightningModule):
    """``self.model(**batch).loss``, as a user writes it; SGD; the batches in the order of Lightning's sampler."""

    def __init__(self, family: str, lr: float = 0.5, select: Optional[list[int]] = None,
                 support: Optional[str] = None) -> None:
        super().__init__()
        self.support = family_support(support)
        self.model = self.support.build_model(family)
        self.lr = lr
        self.select = select
        self.family = family

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(BatchList(self.support.selected_batches(self.select, self.family)), batch_size=1,
                          collate_fn=_first)


def train_single_device(family: str, lr: float = 0.5, select: Optional[list[int]] = None,
                        support: Optional[str] = None) -> dict[str, Any]:
    """The reference: plain transformers on one process, the same batches in Lightning's order, SGD."""
    import inspect

    from tests.support.models import lightning_order

    helpers = family_support(support)
    model = helpers.build_model(family)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    takes_reference = "reference" in inspect.signature(helpers.selected_batches).parameters
    chosen = (helpers.selected_batches(select, family, reference=True) if takes_reference
              else helpers.selected_batches(select, family))
    for batch in [chosen[i] for i in lightning_order(len(chosen), SEED)]:
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.named_parameters()}}


def train_data_parallel_reference(family: str, select: list[int], replicas: int, lr: float = 0.5) -> dict[str, Any]:
    """One process standing in for ``replicas`` data-parallel replicas: step ``k`` takes batch ``order[k·replicas +
    r]`` for replica ``r`` (Lightning's DistributedSampler over the shuffled order), and the step is one device's
    step on the global batch: the loss is the mean over all the replicas' target tokens."""
    from tests.support.models import lightning_order

    model = build_model(family)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    chosen = selected_batches(select, family, reference=True)
    order = lightning_order(len(chosen), SEED)
    losses = []
    for step in range(len(chosen) // replicas):
        optimizer.zero_grad()
        parts = [chosen[order[step * replicas + r]] for r in range(replicas)]
        targets = [int((part["labels"][:, 1:] != -100).sum()) for part in parts]
        loss = sum(model(**part).loss * count for part, count in zip(parts, targets)) / sum(targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.named_parameters()}}


def assert_trains_as_single_device(trained: list[dict], reference: dict[str, Any], key: str,
                                   initial: dict[str, torch.Tensor], vision_prefixes: tuple[str, ...]
                                   ) -> dict[str, torch.Tensor]:
    """The parity bar of every vision-language family: each rank's losses within 1e-5 of the single-device run's, the
    vision tower's attention implementation given back after fit, and rank 0's weights' updates within 1e-4 of the
    reference's, the vision parameters (names starting with ``vision_prefixes``) on their own too. Returns rank 0's
    vision parameters, for a family's own further checks."""
    from tests.test_parity import rel_diff, update_rel_diff

    for rank in trained:
        result = rank[key]
        assert rel_diff(result["losses"], reference["losses"]) <= 1e-5, (result["losses"], reference["losses"])
        assert result["vision_attention"] == "sdpa"  # given back after fit
    weights = trained[0][key]["weights"]
    assert update_rel_diff(weights, reference["weights"], initial) <= 1e-4
    vision = {k: v for k, v in weights.items() if k.startswith(vision_prefixes)}
    assert vision, f"no parameter named {vision_prefixes}"
    assert update_rel_diff(vision, {k: reference["weights"][k] for k in vision}, initial) <= 1e-4
    return vision
