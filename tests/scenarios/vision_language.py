"""Vision-language models trained under SP (``tests/test_vision_language.py``): one fit per (family, ZeRO stage)."""

from __future__ import annotations

import torch
from lightning.pytorch import seed_everything

from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support.training import Recorder, make_trainer
from tests.support.vision import SEED, VisionLanguageLM


def run(payload: dict) -> dict:
    results = {}
    for family, stage in payload["runs"]:
        seed_everything(SEED, verbose=False)
        module = VisionLanguageLM(family, select=payload.get("select"))
        recorder = Recorder()
        trainer = make_trainer(UlyssesDeepSpeedStrategy(sp_size=payload["sp_size"], stage=stage), max_steps=4,
                               callbacks=[recorder])
        trainer.fit(module)
        results[f"{family}-zero{stage}"] = {
            "losses": recorder.losses,
            "input_shapes": recorder.input_shapes,
            "weights": ({k: v.float().cpu() for k, v in recorder.weights.items()}
                        if torch.distributed.get_rank() == 0 else None),
            "vision_attention": module.model.config.vision_config._attn_implementation,
        }
    return results
