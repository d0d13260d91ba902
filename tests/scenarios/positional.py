"""Per-position loss and passkey retrieval under SP (and DP×SP), run by ``tests/test_positional.py`` as
``launch(N, "positional:run", payload)``: ``trainer.validate`` of an untrained tiny Llama on several
data shapes (plain rows, right padding, packed documents, ``tiled_loss``), each with a :class:`PositionalLoss`, and
one validation with the :class:`PasskeyRetrieval` callback."""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch import seed_everything

from lightning_ulysses import PasskeyRetrieval, PositionalLoss, UlyssesDeepSpeedStrategy
from tests.support.models import SEED, DataCausalLM, PackedDataset, TokenDataset, VarLenDataset, pad_right_collate, \
    tiny_llama_config
from tests.support.training import LAUNCH_WORLD_SIZE, make_trainer

EDGES = [0, 1, 2, 4, 8, 16, 32, 64]


class CharTokenizer:
    """A tokenizer for tests: one token per ASCII character (ids 3..127), BOS 1; nothing downloaded."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [min(max(ord(c), 3), 127) for c in text]}

    def decode(self, ids) -> str:
        return "".join(chr(int(i)) for i in ids if int(i) >= 3)


def datasets() -> dict[str, tuple[Any, Any, dict]]:
    return {
        "rows": (TokenDataset(8, 48), None, {}),
        "padded": (VarLenDataset([40, 17, 48, 9, 33, 48, 25, 12]), pad_right_collate, {}),
        "packed": (PackedDataset([[20, 28], [5, 30, 13], [48], [16, 16, 16], [7, 41], [33, 15], [24, 24], [10, 38]]),
                   None, {"sdpa_per_document": True}),
        "tiled": (TokenDataset(8, 48), None, {"tiled_loss": 3}),
    }


class PositionLM(DataCausalLM):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loss_by_position = PositionalLoss(edges=EDGES)

    def validation_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        strategy = self.trainer.strategy
        self.loss_by_position.update(strategy.token_losses(), batch, strategy.token_correct())
        return loss

    def on_validation_epoch_end(self) -> None:
        self.curve = self.loss_by_position.compute().tolist()  # synced over all ranks
        self.accuracy_curve = self.loss_by_position.accuracy().tolist()
        self.log_dict(self.loss_by_position.as_dict("val_loss_at"))


def run(payload: dict) -> dict:
    sp_size = payload["sp_size"]
    results: dict[str, Any] = {}
    for name, (dataset, collate, strategy_kwargs) in datasets().items():
        os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE)
        seed_everything(SEED, verbose=False)
        module = PositionLM(tiny_llama_config(), dataset, batch_size=2, collate_fn=collate)
        trainer = make_trainer(UlyssesDeepSpeedStrategy(sp_size=sp_size, stage=2, **strategy_kwargs), 1,
                               limit_val_batches=None)
        trainer.validate(module, verbose=False)
        results[name] = {"curve": module.curve, "accuracy": module.accuracy_curve,
                         "logged": {k: float(v) for k, v in trainer.callback_metrics.items()}}
    os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE)
    module = PositionLM(tiny_llama_config(), TokenDataset(2, 16), batch_size=1)
    passkey = PasskeyRetrieval(CharTokenizer(), lengths=payload["passkey_lengths"], depths=payload["passkey_depths"],
                               samples=2, output_dir=payload.get("output_dir") if int(os.environ["RANK"]) == 0 else None)
    trainer = make_trainer(UlyssesDeepSpeedStrategy(sp_size=sp_size, stage=3), 1, limit_val_batches=None,
                           callbacks=[passkey])
    trainer.validate(module, verbose=False)
    results["passkey"] = passkey.results
    results["passkey_logged"] = float(trainer.callback_metrics["passkey_accuracy"])
    return results
