"""Fits and evaluations on datasets given in the payload (``tests/test_realdata.py`` and the files reusing it)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import seed_everything

from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support.models import SEED, tiny_llama_config
from tests.support.training import Recorder, make_trainer


def run(payload: dict) -> dict:
    """Fits (and evaluations) on datasets given in the payload; each case: dataset, batch_size, collate_fn,
    strategy kwargs, trainer kwargs, and which of validate/test/predict to run after fit."""
    from lightning_ulysses import SequenceParallelThroughputMonitor
    from tests.support.models import DataCausalLM

    out = {}
    for name, case in payload["cases"].items():
        seed_everything(SEED, verbose=False)
        module = DataCausalLM(tiny_llama_config(num_kv_heads=2), case["dataset"], case.get("batch_size", 1),
                              case.get("collate_fn"))
        recorder = Recorder()
        throughput = SequenceParallelThroughputMonitor(window_size=2)
        strategy = UlyssesDeepSpeedStrategy(sp_size=case.get("sp_size", 2), stage=case.get("stage", 2),
                                            **case.get("strategy", {}))
        trainer = make_trainer(strategy, case.get("max_steps", -1), callbacks=[recorder, throughput],
                               max_epochs=case.get("max_epochs", 1), **case.get("trainer", {}))
        result: dict[str, Any] = {}
        try:
            trainer.fit(module)
        except Exception as err:  # noqa: BLE001 - the test asserts on type and message
            result["error"] = (type(err).__name__, str(err))
            result["steps_run"] = len(recorder.losses)
            out[name] = result
            continue
        result.update(
            losses=recorder.losses,
            input_shapes=recorder.input_shapes,
            tile_shard_lens=recorder.tile_shard_lens,
            weights=recorder.weights if torch.distributed.get_rank() == 0 else None,
            estimated_stepping_batches=trainer.estimated_stepping_batches,
            num_training_batches=trainer.num_training_batches,
            global_step=trainer.global_step,
            throughput_world_sizes=sorted({t.world_size for t in throughput._throughputs.values()}),
        )
        if "validate" in case.get("after", ()):
            metrics = trainer.validate(module, verbose=False)[0]
            result["validate"] = {k: float(v) for k, v in metrics.items()}
        if "test" in case.get("after", ()):
            result["test"] = {k: float(v) for k, v in trainer.test(module, verbose=False)[0].items()}
        if "predict" in case.get("after", ()):
            predictions = trainer.predict(module)
            result["predict"] = [p.float() for p in predictions]
        out[name] = result
    return out
