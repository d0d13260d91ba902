"""fit, validate, test and a second Trainer's fit in one process (``tests/test_lifecycle.py``)."""

from __future__ import annotations

import torch
from lightning.pytorch import seed_everything

from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support.models import SEED, CausalLM, TokenDataset, tiny_llama_config
from tests.support.training import Recorder, make_trainer


def run(payload: dict) -> dict:
    """fit (epoch with a smaller last batch) → validate → test → a second Trainer's fit, in one process."""
    from transformers import PreTrainedModel

    stage = payload["stage"]
    seed_everything(SEED, verbose=False)
    config = tiny_llama_config(num_kv_heads=2)
    dataset = TokenDataset(payload["num_rows"], payload["seq_len"])
    module = CausalLM(config, lr=0.5, dataset=dataset, batch_size=payload["batch_size"])
    recorder = Recorder()
    trainer = make_trainer(UlyssesDeepSpeedStrategy(sp_size=2, stage=stage), max_steps=-1, max_epochs=1,
                           callbacks=[recorder], limit_val_batches=1.0)
    trainer.fit(module)
    restored = {
        "attn_implementation": module.model.config._attn_implementation,
        "has_sp_loss": "_loss_function" in module.model.__dict__,
        "use_cache": module.model.config.use_cache,
    }
    val = trainer.validate(module, verbose=False)[0]["val_loss"]
    test = trainer.test(module, verbose=False)[0]["test_loss"]
    second_recorder = Recorder()
    second = make_trainer(UlyssesDeepSpeedStrategy(sp_size=2, stage=stage), max_steps=2, callbacks=[second_recorder])
    second.fit(module)
    return {
        "losses": recorder.losses,
        "input_shapes": recorder.input_shapes,
        "weights_after_first_fit": recorder.weights if torch.distributed.get_rank() == 0 else None,
        "restored": restored,
        "val_loss": float(val),
        "test_loss": float(test),
        "second_fit_losses": second_recorder.losses,
        "is_pretrained": isinstance(module.model, PreTrainedModel),
    }
