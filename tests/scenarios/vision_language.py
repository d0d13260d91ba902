"""Vision-language models trained under SP (``tests/test_vision_language.py``): one fit per (family, ZeRO stage),
with what the vision path did on each rank recorded per step."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, seed_everything

from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.models import vision_language
from lightning_ulysses.models.form_check import probe_running
from tests.support.training import Recorder, make_trainer
from tests.support.vision import SEED, VisionLanguageLM


class VisionSpy(Callback):
    """Per training step: the pixel rows this rank's vision tower encoded (per call: images, videos) and the
    collectives the vision path issued (feature all-to-alls, modality agreements, row-count exchanges)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self._undo = []

    def setup(self, trainer, pl_module, stage) -> None:
        inner = getattr(pl_module.model, "model", pl_module.model)  # Llama 4 holds its towers itself
        visual = next(getattr(inner, name) for name in ("visual", "vision_tower", "vision_model")
                      if hasattr(inner, name))
        self._undo.append(visual.register_forward_pre_hook(self._encoded, with_kwargs=True))
        original_all_to_all, original_agree = vision_language.all_to_all, vision_language._agree_on_modalities

        def counted_all_to_all(*args, **kwargs):
            self._count("all_to_all")
            return original_all_to_all(*args, **kwargs)

        def counted_agree(*args, **kwargs):
            if not probe_running():
                self._count("agreements")
            return original_agree(*args, **kwargs)

        vision_language.all_to_all, vision_language._agree_on_modalities = counted_all_to_all, counted_agree
        self._originals = (original_all_to_all, original_agree)
        original_row_counts = vision_language._row_counts

        def counted_row_counts(*args, **kwargs):  # the row-count all-reduce of families that learn rows by encoding
            self._count("row_counts")
            return original_row_counts(*args, **kwargs)

        vision_language._row_counts, self._original_row_counts = counted_row_counts, original_row_counts

    def teardown(self, trainer, pl_module, stage) -> None:
        vision_language.all_to_all, vision_language._agree_on_modalities = self._originals
        vision_language._row_counts = self._original_row_counts
        for handle in self._undo:
            handle.remove()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps.append({"encoded_rows": [], "all_to_all": 0, "agreements": 0, "row_counts": 0})

    def _encoded(self, module, args, kwargs) -> None:
        if self.steps:
            pixels = args[0] if args else next(v for k, v in kwargs.items() if k.startswith("pixel_values"))
            self.steps[-1]["encoded_rows"].append(int(pixels.shape[0]))

    def _count(self, name: str) -> None:
        if self.steps:
            self.steps[-1][name] += 1


def run(payload: dict) -> dict:
    results = {}
    # each run: (family, stage), (family, stage, batches selected) or (family, stage, batches selected, sp_size)
    for family, stage, *chosen in payload["runs"]:
        select = chosen[0] if chosen else payload.get("select")
        sp_size = chosen[1] if len(chosen) > 1 else payload["sp_size"]
        replicas = payload.get("processes", sp_size) // sp_size  # Lightning's teardown drops WORLD_SIZE
        seed_everything(SEED, verbose=False)
        module = VisionLanguageLM(family, select=select, support=payload.get("support"))
        recorder, spy = Recorder(), VisionSpy()
        strategy = UlyssesDeepSpeedStrategy(sp_size=sp_size, stage=stage, **payload.get("strategy", {}))
        if stage == 3 and payload.get("partitioned"):  # every parameter partitioned, tiny ones too
            strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        trainer = make_trainer(strategy,
                               max_steps=len(select) // replicas if chosen else payload.get("steps", 4),
                               callbacks=[recorder, spy])
        trainer.fit(module)
        key = f"{family}-zero{stage}" + ("-" + "".join(map(str, select)) if chosen else "")
        results[key + (f"-sp{sp_size}" if len(chosen) > 1 else "")] = {
            "losses": recorder.losses,
            "input_shapes": recorder.input_shapes,
            "weights": ({k: v.float().cpu() for k, v in recorder.weights.items()}
                        if torch.distributed.get_rank() == 0 else None),
            "vision_attention": module.model.config.vision_config._attn_implementation,
            "vision_steps": spy.steps,
            "dp_rank": trainer.strategy.dp_rank,
        }
    return results


def preflight(payload: dict) -> dict:
    """The pre-flight memory check for a vision-language model: ``(family, stage, memory_budget)`` runs at sp=2,
    each the first batch with an image; what stopped it (or the losses), and whether any weight changed."""
    results = {}
    for family, stage, budget in payload["runs"]:
        seed_everything(SEED, verbose=False)
        module = VisionLanguageLM(family, select=[0])
        initial = {k: v.detach().clone() for k, v in module.model.named_parameters()}
        recorder = Recorder()
        strategy = UlyssesDeepSpeedStrategy(sp_size=2, stage=stage, memory_budget=budget)
        result = {"error_type": None, "message": None}
        try:
            make_trainer(strategy, max_steps=1, callbacks=[recorder]).fit(module)
        except Exception as err:  # noqa: BLE001 - the test reads type and message
            result.update(error_type=type(err).__name__, message=str(err))
        result["losses"] = recorder.losses
        result["unchanged"] = all(torch.equal(initial[k], v.detach()) for k, v in module.model.named_parameters())
        results[f"{family}-{budget}"] = result
    return results
