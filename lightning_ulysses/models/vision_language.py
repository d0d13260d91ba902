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
  (``[4, B, s]``, transformers' packed form). A batch that carries its own ``position_ids`` keeps them, as one
  device does (transformers then uses them on all three M-RoPE axes); rows that pack several samples are refused
  with images or videos;
* **image and video features**: the batch's images and videos are split over the SP ranks (by the vision tower's
  independent units: one per temporal patch of an item, so a video's frames are spread and an image goes whole;
  contiguous runs balanced by patch count), each rank runs the vision tower on its share only, and one all-to-all
  sends every feature row to the rank whose shard holds its placeholder token (an image whose tokens straddle a shard
  boundary sends its first rows to one rank and the rest to the next). The rows reach the model as
  ``mm_encoder_outputs``, in the shard's token order, so its own ``masked_scatter`` places them. The all-to-all's
  backward sends each row's gradient back to the rank that encoded it; DeepSpeed's sum over the ranks gives the vision
  tower one device's gradient. Vision memory and time per rank fall with sp.

Every rank runs the vision tower once per modality in a step in which any rank of the world has that modality (one
all-reduce of two flags per call; a rank without an item of its own encodes a minimal dummy item whose output enters
the loss times 0), so that ZeRO's gradient reductions and ZeRO-3's parameter gathers are the same on every rank, also
when data-parallel replicas hold different batches. (A text-only step leaves the tower out; at ZeRO-3 the strategy
clears DeepSpeed's gradient partitions after every optimizer step, so the tower then gets gradient 0, as on one
device.)

Families are listed in :data:`SUPPORTED_FAMILIES`; a batch with images or videos for any other vision-language model
is refused before its forward with that list.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_ulysses import _compat
from lightning_ulysses.context import ShardInfo
from lightning_ulysses.families import vision as vision_families
from lightning_ulysses.families.multimodal_positions import multimodal_call_positions
from lightning_ulysses.families.vision import Modality, VisionFamily
from lightning_ulysses.parallel.exchange import all_to_all
from lightning_ulysses.parallel.layout import group_rank, group_size
from lightning_ulysses.training.step_context import StepContext

# The families this path places: one module each in `vision_families` (model_type -> family).
SUPPORTED_FAMILIES = vision_families.SUPPORTED_FAMILIES


def is_vision_language_model(model: nn.Module) -> bool:
    """A Hugging Face model with a vision tower (its config has a ``vision_config``)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def keep_vision_attention(model: nn.Module, implementation: str) -> None:
    """The vision tower attends over its own patches, never over sequence shards: its config keeps the attention
    implementation ``implementation`` when the model's config was pointed at the strategy's functions (transformers
    passes the top config's implementation down to every sub-config)."""
    vision = getattr(model.config, "vision_config", None)
    if vision is not None:
        _compat.set_attention_implementation(vision, implementation)


def unsupported_family_error(model: nn.Module) -> str:
    model_type = getattr(model.config, "model_type", type(model).__name__)
    return (
        f"{type(model).__name__} ({model_type!r}) was called with images or videos under sequence parallelism, which"
        f" the strategy supports for the vision-language families {sorted(SUPPORTED_FAMILIES)}: for this one it does"
        " not know how the image features and the multimodal positions are placed on the sequence shards. Train it"
        " on text-only batches, use sp_size=1, or one of the supported families."
    )


def complete_call(model: nn.Module, named: dict[str, Any], shard: Optional[ShardInfo], context: StepContext) -> None:
    """Fill a vision-language model's call of a step in place (see the module docstring): ``position_ids`` become the
    shard's multimodal positions ``[4, B, s]``; ``pixel_values`` / ``pixel_values_videos`` become the shard's rows of
    the encoded features (``mm_encoder_outputs``). Called for every call of a prepared vision-language model in a step
    (also text-only ones, which take part in the agreement on which modalities run)."""
    model_type = getattr(model.config, "model_type", None)
    family = vision_families.family_of(model_type)
    if family is not None:
        family.complete_attention(model, named, shard, context)  # e.g. Gemma 3's image blocks
    modalities = family.modalities if family is not None else (vision_families.IMAGE, vision_families.VIDEO)
    present = [named.get(modality.pixels_key) is not None for modality in modalities]
    running = _agree_on_modalities(present, context)
    if not any(running):
        return
    if family is None:
        raise ValueError(unsupported_family_error(model))
    inner = _base_model(model)
    rows = int(named["position_ids"].shape[0])
    if any(present):
        if shard is None or shard.multimodal is None:
            raise ValueError(
                f"{type(model).__name__} was called with images or videos that were not in the step's batch: the"
                " strategy places image features on the shards from the batch the collate step cut. Pass the"
                " batch's `pixel_values` / `image_grid_thw` (and video keys) in the batch itself."
            )
        positions_given = "position_ids" in shard.multimodal  # given positions are kept, as on one device
        if family.rope_index_keys is not None and not positions_given:
            text_positions = named["position_ids"]  # [B, s] global 1-D positions of the shard
            whole = _rope_positions(inner, family, named, shard, text_positions.device)  # [3, B, S]
            named["position_ids"] = multimodal_call_positions(text_positions, whole, shard, rows)  # [4, B, s]
    encoded = dict(named.get("mm_encoder_outputs") or {})
    for modality, runs in zip(modalities, running):
        if not runs:
            continue
        mine = named if named.get(modality.pixels_key) is not None else None
        tensors = _exchanged_features(inner, family, modality, mine, getattr(model.config, modality.token_attr),
                                      shard, rows, context, family.call_options(named))
        for key in family.consumed_keys(modality):
            named.pop(key, None)
        encoded[modality.name] = family.modality_output(modality, tensors)  # [0, H] where this shard has none
    if encoded:
        named["mm_encoder_outputs"] = encoded


def _agree_on_modalities(present: list[bool], context: StepContext) -> list[bool]:
    """Whether any rank of the world runs images / videos in this call (one all-reduce of two flags)."""
    flags = torch.tensor([int(p) for p in present], dtype=torch.int32)
    if group_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        flags = flags.to(device) if device is not None else flags
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # [2]: any rank with images / videos
    return [bool(f) for f in flags.tolist()]


def _base_model(model: nn.Module) -> nn.Module:
    """The module holding the vision feature methods (and ``get_rope_index``): ``model.model`` of the
    ``...ForConditionalGeneration`` classes."""
    inner = getattr(model, "model", model)
    if not hasattr(inner, "get_image_features"):
        raise ValueError(unsupported_family_error(model))
    return inner


def _rope_positions(inner: nn.Module, family: VisionFamily, named: dict[str, Any], shard: ShardInfo,
                    device: torch.device) -> torch.Tensor:
    """``[3, B, S]``: the model's multimodal positions of the whole batch, as one device computes them."""
    multimodal = shard.multimodal
    ids = multimodal["input_ids"]  # [B, S] the whole batch's tokens
    token_types = multimodal.get("mm_token_type_ids")
    if token_types is None:
        token_types = _token_types(inner.config, ids)
    keys = family.rope_index_keys or ()
    extra = {key: named.get(key) for key in keys if named.get(key) is not None}
    with torch.no_grad():
        whole, _ = inner.get_rope_index(ids.to(device), token_types.to(device),
                                        image_grid_thw=named.get("image_grid_thw"),
                                        video_grid_thw=named.get("video_grid_thw"),
                                        attention_mask=_mask_or_none(multimodal, device), **extra)  # [3, B, S]
    return whole


def _mask_or_none(multimodal: dict[str, torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    mask = multimodal.get("attention_mask")
    return None if mask is None else mask.to(device)


def _token_types(config: Any, ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` 0 text, 1 image, 2 video placeholder (what the processor returns as ``mm_token_type_ids``)."""
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == config.image_token_id] = 1
    types[ids == config.video_token_id] = 2
    return types


def _owners(sizes: list[int], sp: int) -> list[int]:
    """The SP rank that encodes each unit: contiguous runs of units, balanced by size (each unit goes to the rank
    whose equal share of the total holds the unit's midpoint)."""
    total = max(sum(sizes), 1)
    owners, before = [], 0
    for size in sizes:
        owners.append(min(sp - 1, (2 * before + size) * sp // (2 * total)))
        before += size
    return owners


def _exchanged_features(inner: nn.Module, family: VisionFamily, modality: Modality, named: Optional[dict[str, Any]],
                        token_id: int, shard: Optional[ShardInfo], rows: int, context: StepContext,
                        options: Optional[dict[str, Any]] = None) -> list[torch.Tensor]:
    """``[n, H_k]`` per feature tensor of the family: the feature rows of the placeholders of this rank's shard, in
    its token order, encoded by the ranks that own their units and exchanged by one all-to-all (see the module
    docstring). ``named`` is ``None`` on a rank whose batch has no item of this modality (another data-parallel
    replica's has). ``options``: the call's arguments for the family's feature methods, in every encoding."""
    group = context.sp_group

    def encode(inputs: dict[str, Any]) -> vision_families.Encoded:
        return family.encode_inputs(inner, modality, {**inputs, **(options or {})})

    distributed = group_size(group) > 1
    sp, me = (group_size(group), group_rank(group)) if distributed else (1, 0)
    if named is None:  # another replica has this modality: encode a dummy to keep ZeRO's collectives in step
        return _detached_rows(encode(family.dummy_inputs(inner, modality)).tensors)
    units = family.units(inner, modality, named, shard)
    owners = _owners(units.sizes, sp)
    mine = [u for u, owner in enumerate(owners) if owner == me]  # contiguous
    if mine:
        first, last = mine[0], mine[-1] + 1
        encoded = encode(family.slice_inputs(inner, modality, named, first, last))
        local = encoded.tensors
    else:
        first = last = 0
        encoded = encode(family.dummy_inputs(inner, modality))
        local = _detached_rows(encoded.tensors)
    widths = [int(t.shape[-1]) for t in local]
    local_rows = torch.cat(local, dim=-1) if len(local) > 1 else local[0]  # [t, sum H_k]
    tokens = units.rows if units.rows is not None else _row_counts(
        encoded.rows_per_unit if mine else [], len(units.sizes), first, local_rows.device,
        group if distributed else None)
    token_start = sum(tokens[:first])
    if mine and int(local_rows.shape[0]) != sum(tokens[first:last]):
        raise ValueError(f"{type(inner).__name__}'s vision tower gave {int(local_rows.shape[0])} feature rows for"
                         f" units {first}..{last - 1}, where the batch's layout gives {sum(tokens[first:last])}.")
    if sp == 1:
        needed = _needed_rows(shard, token_id, rows, shard.global_index).to(local_rows.device) - token_start
        return list(local_rows[needed].split(widths, dim=-1))
    owner_of_row = torch.tensor([owner for owner, count in zip(owners, tokens) for _ in range(count)],
                                dtype=torch.long)  # [N] the rank that encodes each feature row
    geometry = context.geometry
    needed = [_needed_rows(shard, token_id, rows, geometry.shard_index(shard.padded_len, rank)) for rank in range(sp)]
    send = [rows_of[owner_of_row[rows_of] == me] for rows_of in needed]  # per destination, in its token order
    sources = owner_of_row[needed[me]]  # [n] who sends each of my rows
    received = all_to_all(local_rows[torch.cat(send).to(local_rows.device) - token_start],  # [sum(send), sum H_k]
                          [len(rows_of) for rows_of in send], [int((sources == s).sum()) for s in range(sp)], group)
    # received is grouped by source rank, each group in my token order: put it back in my token order
    order = torch.cat([(sources == s).nonzero(as_tuple=True)[0] for s in range(sp)])  # [n] my position of each row
    return list(received[torch.argsort(order).to(received.device)].split(widths, dim=-1))  # [n, H_k] in token order


def _detached_rows(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[0, H_k]`` each, connected to the graph with gradient 0 (a dummy item's output)."""
    zero = sum(t.sum() for t in tensors) * 0
    return [t[:0] + zero for t in tensors]


def _row_counts(rows_per_unit: Optional[list[int]], units: int, first: int, device: torch.device,
                group: Any) -> list[int]:
    """The feature rows of every unit of a family whose rows only encoding tells: each rank writes its own units'
    counts and the SP group sums them (one all-reduce of ``units`` integers)."""
    if rows_per_unit is None:
        raise ValueError("A vision family without a fixed number of feature rows per unit must report the rows its"
                         " encoding gave per unit (Encoded.rows_per_unit).")
    counts = torch.zeros(units, dtype=torch.long)
    counts[first:first + len(rows_per_unit)] = torch.tensor(rows_per_unit, dtype=torch.long)
    if group is not None:
        counts = counts.to(device) if device.type == "cuda" else counts
        dist.all_reduce(counts, group=group)  # [units]: every rank wrote its own units' counts
    return counts.cpu().tolist()


def _needed_rows(shard: ShardInfo, token_id: int, rows: int, index: torch.Tensor) -> torch.Tensor:
    """``[n]``: the feature row numbers (one per placeholder token of the whole batch, in row-major token order) of
    the placeholders at the padded-row positions ``index`` of the first ``rows`` rows, in that shard's token order."""
    ids = shard.multimodal["input_ids"]  # [B, S]
    placeholder = ids == token_id
    number = placeholder.flatten().long().cumsum(0).view(placeholder.shape) - 1  # [B, S]
    S = ids.shape[1]
    real = index < S
    held = torch.zeros((ids.shape[0], index.shape[0]), dtype=torch.bool)  # [B, s]
    held[:, real] = placeholder[:, index[real]]
    return number[:, index.clamp(max=S - 1)][held[:rows].nonzero(as_tuple=True)]
