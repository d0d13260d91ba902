"""LLaVA-NeXT and LLaVA-OneVision: any-resolution images cut into tiles, 1-D text positions; OneVision's videos.

Images: ``pixel_values [images, tiles, C, H, W]`` (tiles padded to the batch's most; or ``[all tiles, C, H, W]``,
each image's in turn), ``image_sizes [images, 2]`` (height, width in pixels). An image's tiles are its whole picture
resized (the base tile) and the crops of the grid resolution its size selects; its feature rows are the base tile's
rows, then the grid's rows unpadded to the picture's aspect ratio (OneVision: shrunk to at most
``vision_aspect_ratio`` tiles) with an image-newline row after each line. Unpadding and newline rows work on all
tiles of the image together, so each image is one unit of the vision tower (its work: its tiles), and how many rows
it gives only its encoding tells (:class:`Units` without ``rows``: the ranks exchange their images' row counts).
OneVision encodes the images of a sample with several (``batch_num_images`` > 1) from their base tile only; such a
sample's images form one unit, so that every run of units says the same to the model's ``batch_num_images``.

Videos (OneVision): ``pixel_values_videos [videos, frames, C, H, W]``; every frame gives the same number of pooled
rows and each video one image-newline row after its last frame. Each frame is one unit: a rank encodes its run of
frames in one call of the model's ``get_video_features`` (one video of all the run's frames) and writes the newline
row after each video that ends in the run.

The call's ``vision_feature_layer`` and ``vision_feature_select_strategy`` reach the model's feature methods as its
forward passes them (OneVision's ``vision_aspect_ratio`` does not: its forward leaves the images to the config's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_ulysses.context import ShardInfo
from lightning_ulysses.families.vision.base import IMAGE, VIDEO, Encoded, Modality, Units, VisionFamily

# The keyword arguments of a call that the model's forward passes on to its feature methods.
FEATURE_OPTIONS = ("vision_feature_layer", "vision_feature_select_strategy")


@dataclass(frozen=True)
class ImageGroup:
    """One unit of images: ``count`` images from image ``start``; ``tiled`` unless they are the base-only images of
    a OneVision sample with several."""

    start: int
    count: int
    tiled: bool


def tiles_of(inner: nn.Module, image_size: list[int]) -> int:
    """The tiles the model takes of an image of ``image_size`` (height, width): the base tile and the grid's crops."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    return int(image_size_to_num_patches(image_size, inner.config.image_grid_pinpoints,
                                         inner.config.vision_config.image_size))


def image_groups(named: dict[str, Any], by_sample: bool) -> list[ImageGroup]:
    """The batch's images as units: one per image, or (``by_sample``: OneVision) one per sample with several."""
    images = int(named["image_sizes"].shape[0])
    per_sample = named.get("batch_num_images") if by_sample else None
    if per_sample is None:
        return [ImageGroup(k, 1, True) for k in range(images)]
    groups, start = [], 0
    for count in (int(n) for n in per_sample):
        if count == 1:
            groups.append(ImageGroup(start, 1, True))
        elif count > 1:
            groups.append(ImageGroup(start, count, False))
        start += count
    if start != images:
        raise ValueError(f"The batch's batch_num_images {per_sample.tolist()} count {start} images where"
                         f" image_sizes holds {images}.")
    return groups


def frames_of(named: dict[str, Any]) -> tuple[int, int]:
    """``(videos, frames per video)`` of the batch's ``pixel_values_videos``."""
    videos, frames = named[VIDEO.pixels_key].shape[:2]
    return int(videos), int(frames)


def pooled_rows_per_frame(inner: nn.Module) -> int:
    """A frame's feature rows: the tower's patch grid pooled by 2 per side (rounded up), as the model pools."""
    side = inner.config.vision_config.image_size // inner.config.vision_config.patch_size
    return ((side + 1) // 2) ** 2


class LlavaNextFamily(VisionFamily):
    """LLaVA-NeXT: any-resolution images (see the module docstring)."""

    model_types = ("llava_next",)
    modalities = (IMAGE,)
    # OneVision's `batch_num_images`: the images of a sample with several are encoded from their base tile only
    images_by_sample = False

    def call_options(self, named: dict[str, Any]) -> dict[str, Any]:
        return {key: named[key] for key in FEATURE_OPTIONS if named.get(key) is not None}

    def units(self, inner: nn.Module, modality: Modality, named: dict[str, Any], shard: ShardInfo) -> Units:
        if modality is VIDEO:
            videos, frames = frames_of(named)
            per_frame = pooled_rows_per_frame(inner)
            rows = [per_frame + (frame == frames - 1) for _ in range(videos) for frame in range(frames)]
            return Units([1] * len(rows), rows)
        tiles = self._image_tiles(inner, named)
        return Units([sum(tiles[group.start:group.start + group.count])
                      for group in image_groups(named, self.images_by_sample)], None)

    def _image_tiles(self, inner: nn.Module, named: dict[str, Any]) -> list[int]:
        """The tiles the model takes of each image: the base tile and its grid's, or the base tile only (OneVision's
        images of a sample with several)."""
        sizes = named["image_sizes"].tolist()
        tiled = [group.tiled for group in image_groups(named, self.images_by_sample) for _ in range(group.count)]
        return [tiles_of(inner, size) if whole else 1 for size, whole in zip(sizes, tiled)]

    def slice_inputs(self, inner: nn.Module, modality: Modality, named: dict[str, Any], first: int,
                     last: int) -> dict[str, Any]:
        if modality is VIDEO:
            return self._frames(named, first, last)
        groups = image_groups(named, self.images_by_sample)[first:last]
        start, stop = groups[0].start, groups[-1].start + groups[-1].count
        pixels = named[modality.pixels_key]
        if pixels.ndim == 5:  # [images, tiles (padded), C, H, W]
            pixels = pixels[start:stop]
        else:  # [all tiles, C, H, W]: each image's tiles in turn
            tiles = self._image_tiles(inner, named)
            pixels = pixels[sum(tiles[:start]):sum(tiles[:stop])]
        inputs = {"pixel_values": pixels, "image_sizes": named["image_sizes"][start:stop],
                  "images_per_unit": [g.count for g in groups]}
        per_sample = named.get("batch_num_images") if self.images_by_sample else None
        if per_sample is not None:  # a unit of several base-only images is one such sample, any other one image
            inputs["batch_num_images"] = torch.tensor(inputs["images_per_unit"], device=per_sample.device)
        return inputs

    @staticmethod
    def _frames(named: dict[str, Any], first: int, last: int) -> dict[str, Any]:
        """Frames ``first`` to ``last - 1`` of all videos as one video ``[1, n, C, H, W]``, and the pieces of whole
        or partial videos they make: their frames and whether the video ends there."""
        videos, frames = frames_of(named)
        pixels = named[VIDEO.pixels_key].flatten(0, 1)[first:last]  # [n, C, H, W]
        pieces, unit = [], first
        while unit < last:
            video_end = (unit // frames + 1) * frames
            pieces.append((min(last, video_end) - unit, last >= video_end))
            unit = min(last, video_end)
        return {"pixel_values_videos": pixels[None], "pieces": pieces}

    def dummy_inputs(self, inner: nn.Module, modality: Modality) -> dict[str, Any]:
        """One blank image of the tower's size (all the tiles the model cuts it into), or one blank frame."""
        vision = inner.config.vision_config
        device = next(inner.parameters()).device
        side = vision.image_size
        if modality is VIDEO:
            return {"pixel_values_videos": torch.zeros(1, 1, vision.num_channels, side, side, device=device),
                    "pieces": [(1, True)]}
        tiles = tiles_of(inner, [side, side])
        return {"pixel_values": torch.zeros(1, tiles, vision.num_channels, side, side, device=device),
                "image_sizes": torch.tensor([[side, side]], device=device), "images_per_unit": [1]}

    def encode_inputs(self, inner: nn.Module, modality: Modality, inputs: dict[str, Any]) -> Encoded:
        options = {key: inputs[key] for key in FEATURE_OPTIONS if key in inputs}
        if modality is VIDEO:
            return Encoded([self._video_rows(inner, inputs, options)])
        extra = {"batch_num_images": inputs["batch_num_images"]} if "batch_num_images" in inputs else {}
        output = inner.get_image_features(pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"],
                                          return_dict=True, **options, **extra)
        per_image = [int(rows.shape[0]) for rows in output.pooler_output]  # [rows_k, H] per image
        per_unit, start = [], 0
        for count in inputs["images_per_unit"]:
            per_unit.append(sum(per_image[start:start + count]))
            start += count
        return Encoded([torch.cat(list(output.pooler_output))], per_unit)  # [t, H]

    @staticmethod
    def _video_rows(inner: nn.Module, inputs: dict[str, Any], options: dict[str, Any]) -> torch.Tensor:
        """``[t, H]``: the run's frame rows in order, the newline row after each video that ends in the run."""
        pixels = inputs["pixel_values_videos"]  # [1, n, C, H, W]
        output = inner.get_video_features(pixel_values_videos=pixels, return_dict=True, **options)
        rows = output.pooler_output[0]  # [n · per_frame + 1, H]: the frames' rows, then one newline row
        frames_rows, newline = rows[:-1], rows[-1:]
        per_frame = frames_rows.shape[0] // pixels.shape[1]
        parts, frame = [], 0
        for count, ends in inputs["pieces"]:
            parts.append(frames_rows[frame * per_frame:(frame + count) * per_frame])
            if ends:
                parts.append(newline)
            frame += count
        out = torch.cat(parts)
        if not any(ends for _, ends in inputs["pieces"]):  # the newline stays in the graph (gradient 0) on every rank
            out = out + newline.sum() * 0
        return out

    def modality_output(self, modality: Modality, tensors: list[torch.Tensor]) -> Any:
        """Images as the model's tuple of rows; videos as ``[1, n, H]`` (the model flattens its videos' rows)."""
        if modality is not VIDEO:
            return self.encoder_output(tensors)
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        return BaseModelOutputWithPooling(pooler_output=tensors[0][None])


class LlavaOnevisionFamily(LlavaNextFamily):
    """LLaVA-OneVision: LLaVA-NeXT's images (several per sample from their base tile), and videos."""

    model_types = ("llava_onevision",)
    modalities = (IMAGE, VIDEO)
    images_by_sample = True
