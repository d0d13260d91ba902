"""Attention classes of transformers that the structural rules of
:func:`lightning_ulysses.models.refusals._attention_kind` decide by name, because what they do cannot be seen from
their structure before any compute: those that call torch's SDPA themselves, and those defined next to the attention
interface that do not dispatch through it. A guard (``tests/families/test_registry.py``) re-derives both from the
installed transformers' sources."""

from __future__ import annotations

# Attention classes that call torch.nn.functional.scaled_dot_product_attention themselves instead of looking their
# kernel up in transformers' attention interface (the complete list in transformers 5.23). The strategy can put the
# exchange around those calls (lightning_ulysses.models.hf).
CALLS_SDPA_ITSELF = frozenset({
    "Data2VecVisionSdpaSelfAttention", "DeepseekOcr2SamVisionSdpaAttention", "FalconAttention",
    "GraniteSpeechConformerAttention", "GraniteSpeechPlusConformerAttention", "SamHQVisionSdpaAttention",
    "SamVisionSdpaAttention", "UnlimitedOcrSamVisionSdpaAttention",
})

# Attention classes defined in a modeling module that has transformers' attention interface
# (``ALL_ATTENTION_FUNCTIONS``) but that do not dispatch through it: wrappers around the module that attends (BERT's
# BertAttention around BertSelfAttention, T5's layer wrappers), sequence mixers named "...Attention", local, sparse,
# deformable, audio and vision attentions that compute their own scores. The complete list in transformers 5.23;
# most of them the structural rules of lightning_ulysses.models.refusals._attention_kind also recognise, the list makes the decision independent of
# them. A class that is not listed is decided by those rules.
NOT_THROUGH_INTERFACE = frozenset({
    "AlignTextAttention", "AltRobertaAttention", "AriaCrossAttention", "BailingHybridDeltaAttention",
    "BertAttention", "BertGenerationAttention", "BigBirdPegasusBlockSparseAttention",
    "BigBirdPegasusEncoderAttention", "BigBirdPegasusSelfAttention", "Blip2QFormerAttention",
    "BridgeTowerAttention", "BridgeTowerResidualAttention", "CamembertAttention", "ChineseCLIPTextAttention",
    "ClapAudioAttention", "ClapAudioSelfAttention", "ClapTextAttention", "DFineMultiscaleDeformableAttention",
    "DPTViTAttention", "Data2VecTextAttention", "DeepseekOcr2SamVisionAttention",
    "DeformableDetrMultiscaleDeformableAttention", "Deimv2MultiscaleDeformableAttention",
    "EdgeTamVideoMemoryAttention", "EfficientLoFTRAggregatedAttention", "ElectraAttention", "ErnieAttention",
    "EsmAttention", "EvollaSaProtAttention", "EvollaSequenceAlignerCrossAttention",
    "EvollaSequenceCompressorAttention", "Gemma3nAudioAttention", "Gemma3nAudioConformerAttention",
    "Gemma4AudioAttention", "GitAttention", "GitSelfAttention", "Glm5NextTextLinearAttention",
    "InformerProbSparseAttention", "InstructBlipQFormerAttention", "InstructBlipVideoQFormerAttention",
    "KimiLinearDeltaAttention", "LayoutLMAttention", "LongT5LayerCrossAttention", "LongT5LayerLocalSelfAttention",
    "LongT5LayerSelfAttention", "LongT5LayerTransientGlobalSelfAttention", "LongT5LocalAttention",
    "LongT5TransientGlobalAttention", "LwDetrMultiscaleDeformableAttention", "MT5LayerCrossAttention",
    "MT5LayerSelfAttention", "MarkupLMAttention", "MiniMaxLightningAttention", "MobileBertAttention",
    "MultiScaleDeformableAttention", "NeoMMEExclusiveSelfAttention", "PPDocLayoutV2MultiscaleDeformableAttention",
    "PPDocLayoutV2ReadingOrderAttention", "PPDocLayoutV2ReadingOrderSelfAttention",
    "PPDocLayoutV3MultiscaleDeformableAttention", "PPDocLayoutV4MultiscaleDeformableAttention",
    "PPFormulaNetVisionAttention", "PatchTSMixerGatedAttention", "PegasusXGlobalLocalAttention",
    "Pix2StructTextLayerCrossAttention", "Pix2StructTextLayerSelfAttention", "Pop2PianoLayerCrossAttention",
    "Pop2PianoLayerSelfAttention", "RTDetrMultiscaleDeformableAttention", "RTDetrV2MultiscaleDeformableAttention",
    "RfDetrMultiscaleDeformableAttention", "RoCBertAttention", "RobertaAttention", "RobertaPreLayerNormAttention",
    "Sam2VideoMemoryAttention", "Sam3TrackerVideoMemoryAttention", "SamHQVisionAttention", "SamVisionAttention",
    "SplinterAttention", "SwitchTransformersLayerCrossAttention", "SwitchTransformersLayerSelfAttention",
    "T5LayerCrossAttention", "T5LayerSelfAttention", "UMT5LayerCrossAttention", "UMT5LayerSelfAttention",
    "UdopLayerCrossAttention", "UdopLayerSelfAttention", "UnlimitedOcrSamVisionAttention", "VideoMAEAttention",
    "VitPoseBackboneAttention", "XLMRobertaAttention", "XLMRobertaXLAttention", "XmodAttention", "YolosAttention",
})
