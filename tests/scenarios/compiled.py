"""``torch.compile`` of the model a user trains with the strategy (``tests/test_compile.py``)."""

from __future__ import annotations

import os

from lightning.pytorch import seed_everything

from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support.models import SEED, CausalLM, TokenDataset, tiny_llama_config
from tests.support.training import LAUNCH_WORLD_SIZE, Recorder, make_trainer

ROWS, SEQ_LEN, BATCH, STEPS = 2, 32, 2, 3  # one batch: every device trains on the same rows each step


def fit(strategy, backend: str) -> dict:
    seed_everything(SEED, verbose=False)
    module = CausalLM(tiny_llama_config(num_kv_heads=2), lr=0.5, dataset=TokenDataset(ROWS, SEQ_LEN),
                      batch_size=BATCH)
    module.model.compile(backend=backend)  # nn.Module.compile: in place, as a user writes it
    recorder = Recorder()
    os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE if strategy is not None else 1)
    trainer = make_trainer(strategy if strategy is not None else "auto", STEPS, callbacks=[recorder],
                           devices=LAUNCH_WORLD_SIZE if strategy is not None else 1)
    trainer.fit(module)
    from torch._dynamo.utils import counters

    return {"losses": recorder.losses, "graphs": int(counters["stats"]["unique_graphs"]),
            "weights": {k: v.float().cpu() for k, v in recorder.weights.items()} if recorder.weights else
            {k: v.detach().float().clone() for k, v in module.model.named_parameters()}}


def run(payload: dict) -> dict:
    import torch._dynamo

    results = {}
    for name, keywords in payload["settings"].items():
        torch._dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
        keywords = dict(keywords)
        backend = keywords.pop("backend")
        config = keywords.pop("config", None)
        strategy = UlyssesDeepSpeedStrategy(sp_size=2, **keywords)
        if config:
            strategy.config["zero_optimization"].update(config)
        try:
            results[name] = fit(strategy, backend)
        except Exception as err:  # noqa: BLE001 - reported to the test
            results[name] = {"error": f"{type(err).__name__}: {err}"[:3000]}
    return results
