"""Lightning's ecosystem under SP=2 (``tests/test_ecosystem.py``): ``generate()`` inside ``predict_step`` and
``validation_step`` on the batch's (sharded) prompt."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, seed_everything
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support.models import SEED, CausalLM, TokenDataset, tiny_llama_config
from tests.support.training import LAUNCH_WORLD_SIZE, make_trainer

NEW_TOKENS = 8


class Generating(CausalLM):
    """``self.model.generate(batch["input_ids"], ...)`` in predict and validation steps, as on one device."""

    def __init__(self) -> None:
        super().__init__(tiny_llama_config(num_kv_heads=2), dataset=TokenDataset(4, 16))
        self.validation_tokens: list[list[list[int]]] = []

    def predict_step(self, batch, batch_idx):
        return self.model.generate(batch["input_ids"], max_new_tokens=NEW_TOKENS, do_sample=False)

    def validation_step(self, batch, batch_idx):
        out = self.model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                  max_new_tokens=NEW_TOKENS, do_sample=False)
        self.validation_tokens.append(out.tolist())


def _rows() -> list[dict[str, torch.Tensor]]:
    rows = TokenDataset(2, 16, seed=11).rows
    return [{"input_ids": r, "attention_mask": torch.ones_like(r)} for r in rows]


def generate_in_steps(case: dict) -> dict:
    os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE)
    seed_everything(SEED, verbose=False)
    module = Generating()
    weights = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    trainer = make_trainer(UlyssesDeepSpeedStrategy(sp_size=2, stage=case["stage"]), 1)
    predictions = trainer.predict(module, DataLoader(_rows(), batch_size=1), return_predictions=True)
    os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE)
    trainer = make_trainer(UlyssesDeepSpeedStrategy(sp_size=2, stage=case["stage"]), 1, limit_val_batches=1.0)
    trainer.validate(module, DataLoader(_rows(), batch_size=1))
    return {"predictions": [p.tolist() for p in predictions], "validation": module.validation_tokens,
            "weights": weights if dist.get_rank() == 0 else None}


def run(payload: dict) -> dict[str, Any]:
    return {case["name"]: generate_in_steps(case) for case in payload["cases"]}


def ema(case: dict) -> dict:
    """``EMAWeightAveraging(decay=0.5)`` over 3 SGD steps; at ZeRO 3 with parameters partitioned (``partitioned``) or
    not. The final weights are the average (Lightning copies it into the model when training ends)."""
    import deepspeed
    from lightning.pytorch.callbacks import EMAWeightAveraging

    os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE)
    seed_everything(SEED, verbose=False)
    module = CausalLM(tiny_llama_config(num_kv_heads=2), dataset=TokenDataset(8, 16))
    initial = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    strategy = UlyssesDeepSpeedStrategy(sp_size=2, stage=case["stage"])
    if case.get("partitioned"):
        strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    trainer = make_trainer(strategy, 3, callbacks=[EMAWeightAveraging(decay=0.5)])
    result: dict[str, Any] = {"error_type": None, "message": None}
    try:
        trainer.fit(module)
    except Exception as err:  # noqa: BLE001 - the test asserts on type and message
        result.update(error_type=type(err).__name__, message=str(err))
    params = dict(module.model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=case["stage"] == 3 and
                                           result["error_type"] is None):
        final = {k: v.detach().clone() for k, v in params.items()}
    result["weights"] = final if dist.get_rank() == 0 else None
    result["unchanged"] = all(torch.equal(initial[k], final[k]) for k in initial) if result["error_type"] else None
    result["global_step"] = trainer.global_step
    return result


def run_ema(payload: dict) -> dict[str, Any]:
    return {case["name"]: ema(case) for case in payload["cases"]}


# ------------------------------------------------------------------------------------------------ refusals mid-fit
class EncoderRows(torch.utils.data.Dataset):
    """Rows of 16 tokens for a BERT masked LM; the last row is padded in its second half only (on the second SP
    rank's shard)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(5, 21) + i
        mask = torch.ones(16, dtype=torch.long)
        if i == 3:
            mask[12:] = 0
            ids = ids.masked_fill(mask == 0, 0)
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class EncoderModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from tests.support.forms import _bert

        self.model = _bert(0)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(EncoderRows(), batch_size=1)


def encoder_padding_mid_fit(case: dict) -> dict:
    os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE)
    seed_everything(SEED, verbose=False)
    trainer = make_trainer(UlyssesDeepSpeedStrategy(sp_size=2, stage=2), 4)
    result: dict[str, Any] = {"error_type": None, "message": None}
    try:
        trainer.fit(EncoderModule())
    except Exception as err:  # noqa: BLE001
        result.update(error_type=type(err).__name__, message=str(err))
    result["global_step"] = trainer.global_step
    return result


def run_refusals(payload: dict) -> dict[str, Any]:
    return {"encoder_padding": encoder_padding_mid_fit({})}
