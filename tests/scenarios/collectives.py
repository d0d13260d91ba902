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


def _step_overhead_benchmark():
    """``benchmarks/step_overhead.py`` (its tracer and op counter)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "step_overhead.py"
    spec = importlib.util.spec_from_file_location("_step_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def step_overhead(payload: dict) -> dict:
    """What the strategy's own code does in one steady training step (the second, after the model-form check's
    first), counted by ``benchmarks/step_overhead.py``'s tracer and op counter, per ``ring_size``: entries into the
    strategy's code, its collectives and host syncs, and the SP attention's collectives."""
    from lightning.pytorch import Callback

    bench = _step_overhead_benchmark()

    class CountStep(Callback):
        def __init__(self) -> None:
            self.tracer = bench.StepTracer()
            self.ops = bench.op_counter(self.tracer)
            self.counts: dict = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == 0:  # from the first step's end to the second's: one whole step, its collate included
                self.tracer.start()
                self.ops.__enter__()
            elif batch_idx == 1:
                self.ops.__exit__(None, None, None)
                self.tracer.stop()
                self.counts = bench.per_step_counts(self.tracer, self.ops.counts)

    class ExtraForwards(CountingCausalLM):
        """Before its loss, the step runs the model ``extra`` more times without labels (a reference or value model's
        forward, hidden states for an extra head), given the batch's own positions and mask as ``**batch`` gives
        them."""

        extra = 0

        def training_step(self, batch, batch_idx):
            inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
            for _ in range(self.extra):
                self.model(**inputs)
            return super().training_step(batch, batch_idx)

    out = {}
    for ring_size in payload["ring_sizes"]:
        for extra in payload.get("extra_forwards", [0]):
            seed_everything(SEED, verbose=False)
            module = ExtraForwards(tiny_llama_config(num_kv_heads=2, layers=2), dataset=TokenDataset(4, 32))
            module.extra = extra
            counter = CountStep()
            strategy = UlyssesDeepSpeedStrategy(sp_size=2, stage=2, ring_size=ring_size)
            make_trainer(strategy, max_steps=3, callbacks=[counter]).fit(module)
            out[ring_size if extra == 0 else (ring_size, extra)] = counter.counts
    return out
