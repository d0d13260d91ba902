"""Gemma 3 trained under SP (``tests/test_vlm_gemma3.py``): the fits of :mod:`tests.scenarios.vision_language`, with
a spy that reads the pixels Gemma 3 gives its SigLIP tower by keyword, and one that records, per step, the image
blocks each of the SP attention's calls attended within (global ``(row, start, end)``)."""

from __future__ import annotations

from lightning.pytorch import Callback

from lightning_ulysses.models import hf_attention
from tests.scenarios import vision_language


class KeywordVisionSpy(vision_language.VisionSpy):
    """:class:`~tests.scenarios.vision_language.VisionSpy`, the encoded pixels read positionally or by keyword."""

    def _encoded(self, module, args, kwargs) -> None:
        if self.steps:
            pixels = args[0] if args else kwargs["pixel_values"]
            self.steps[-1]["encoded_rows"].append(int(pixels.shape[0]))


class BlockSpy(Callback):
    """Per training step, the ``ImageBlocks.spans`` of every call of the SP attention that took the block path."""

    steps: list = []

    def setup(self, trainer, pl_module, stage) -> None:
        original = hf_attention.attend_image_blocks

        def recorded(attend, q, k, v, causal, blocks, window=None):
            if BlockSpy.steps and blocks:
                BlockSpy.steps[-1].append(blocks.spans)
            return original(attend, q, k, v, causal, blocks, window)

        self._original = original
        hf_attention.attend_image_blocks = recorded

    def teardown(self, trainer, pl_module, stage) -> None:
        hf_attention.attend_image_blocks = self._original

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        BlockSpy.steps.append([])


def run(payload: dict) -> dict:
    """The fits of ``payload["runs"]``, each with the block calls of its steps under ``"block_calls"``."""
    vision_language.VisionSpy = KeywordVisionSpy  # this worker process runs these fits only
    make_trainer = vision_language.make_trainer
    fit_blocks = []

    def with_block_spy(strategy, max_steps, callbacks=(), **kwargs):
        BlockSpy.steps = []
        fit_blocks.append(BlockSpy.steps)
        return make_trainer(strategy, max_steps, callbacks=[*callbacks, BlockSpy()], **kwargs)

    vision_language.make_trainer = with_block_spy
    results = vision_language.run(payload)
    for (family, stage, *_), steps in zip(payload["runs"], fit_blocks):
        results[f"{family}-zero{stage}"]["block_calls"] = steps
    return results
