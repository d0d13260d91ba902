"""Collectives of one training step's forward and backward, counted per number of layers
(``tests/test_collectives.py``, ``tests/test_ring.py``)."""

from __future__ import annotations

from lightning.pytorch import seed_everything

from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support.models import SEED, CountingCausalLM, TokenDataset, count_ring_passes, tiny_llama_config
from tests.support.training import make_trainer


def run(payload: dict) -> dict:
    """Collectives of one training step's forward and backward, per number of layers."""
    count_ring_passes()
    out = {}
    for layers in payload["layers"]:
        seed_everything(SEED, verbose=False)
        config = tiny_llama_config(num_kv_heads=payload["kv_heads"], layers=layers)
        module = CountingCausalLM(config, dataset=TokenDataset(2, 32))
        strategy = UlyssesDeepSpeedStrategy(sp_size=payload.get("sp_size", 2), stage=payload["stage"],
                                            ring_size=payload.get("ring_size", 1))
        trainer = make_trainer(strategy, max_steps=1)
        trainer.fit(module)
        out[layers] = {"forward": module.forward_counts, "backward": module.backward_counts}
    return out
