"""Qwen3-VL (and its MoE) and Qwen3.5 (and its MoE): the Qwen grid layout of :mod:`.qwen` (patch rows, a
``[items, 3]`` grid per modality, one unit per temporal patch of an item, multimodal RoPE from ``get_rope_index``).

* **Qwen3-VL deepstack**: besides the merged rows written into the placeholders' embeddings, the vision tower gives
  one more feature row per placeholder for each of its ``deepstack_visual_indexes`` layers; the decoder adds the
  ``k``-th to its hidden states at the visual positions after its layer ``k``. They are extra feature tensors of the
  encoded run (``Encoded.tensors[1:]``): each row travels with its merged row in the same all-to-all, so every rank
  gets the deepstack rows of its shard's placeholders in token order, and the model gets them as
  ``deepstack_features`` of its ``mm_encoder_outputs``.
* **Videos**: both families' ``get_rope_index`` take one grid per temporal patch (the processor writes each temporal
  patch as ``<timestamp> <vision_start> tokens <vision_end>``); their vision towers attend within a temporal patch and
  place their learned position embeddings by height and width only, so the unit per temporal patch is exact.
* **Qwen3.5's decoder** mixes gated delta nets (run head-parallel on the whole sequence,
  :mod:`lightning_ulysses.models.mixers`; they take no positions) and gated attention taking the shard's
  ``[4, B, s]`` positions (text positions first) as the Qwen2-VL decoders do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_ulysses.families.vision.base import IMAGE, Encoded, Modality, encoder_rows
from lightning_ulysses.families.vision.qwen import QwenGridFamily


class Qwen3VLFamily(QwenGridFamily):
    """Qwen3-VL and Qwen3-VL-MoE: the merged rows, then one tensor per deepstack layer (``[t, H]`` each)."""

    model_types = ("qwen3_vl", "qwen3_vl_moe")

    def encode_inputs(self, inner: nn.Module, modality: Modality, inputs: dict[str, Any]) -> Encoded:
        method = inner.get_image_features if modality is IMAGE else inner.get_video_features
        output = method(inputs["pixels"], inputs["grid"], return_dict=True)
        deepstack = [torch.cat(list(layer), dim=0) for layer in output.deepstack_features]  # [t, H] per layer
        return Encoded([encoder_rows(output), *deepstack])

    def encoder_output(self, tensors: list[torch.Tensor]) -> Any:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        return BaseModelOutputWithDeepstackFeatures(pooler_output=(tensors[0],),
                                                    deepstack_features=[(rows,) for rows in tensors[1:]])


class Qwen35Family(QwenGridFamily):
    """Qwen3.5 and Qwen3.5-MoE: one feature tensor, as Qwen2-VL."""

    model_types = ("qwen3_5", "qwen3_5_moe")
