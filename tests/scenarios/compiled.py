"""``torch.compile`` of the model a user trains with the strategy (``tests/test_compile.py``)."""

from __future__ import annotations

import os

import torch
from lightning.pytorch import seed_everything

from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.support.models import SEED, CausalLM, TokenDataset, tiny_llama_config
from tests.support.training import LAUNCH_WORLD_SIZE, Recorder, make_trainer

ROWS, SEQ_LEN, BATCH, STEPS = 2, 32, 2, 3  # one batch: every device trains on the same rows each step
WRAPPED = "_orig_mod."  # what torch.compile's wrapper puts before every parameter name


def _recording_aot_eager(graphs: list) -> object:
    """``aot_eager``, noting each graph dynamo hands it: whether one of the strategy's all-to-alls was traced into
    it (in the graph or in the body of an autograd function it holds)."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm: torch.fx.GraphModule, example_inputs):
        targets = [str(node.target) for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
                   for node in sub.graph.nodes if node.op == "call_function"]
        graphs.append(any("all_to_all" in target for target in targets))
        return aot_eager(gm, example_inputs)

    return backend


def fit(strategy, form: str, backend) -> dict:
    seed_everything(SEED, verbose=False)
    module = CausalLM(tiny_llama_config(num_kv_heads=2), lr=0.5, dataset=TokenDataset(ROWS, SEQ_LEN),
                      batch_size=BATCH)
    options = {} if backend is None else {"backend": backend}  # None: torch.compile's default (inductor)
    if form == "wrapper":
        module.model = torch.compile(module.model, **options)  # as a user writes it: an OptimizedModule
    else:
        module.model.compile(**options)  # nn.Module.compile: in place
    recorder = Recorder()
    os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE)
    trainer = make_trainer(strategy, STEPS, callbacks=[recorder], devices=LAUNCH_WORLD_SIZE)
    trainer.fit(module)
    from torch._dynamo.utils import counters

    return {"losses": recorder.losses, "graphs": int(counters["stats"]["unique_graphs"]),
            "weights": {k.replace(WRAPPED, ""): v.float().cpu() for k, v in recorder.weights.items()}}


def run(payload: dict) -> dict:
    import torch._dynamo

    results = {}
    for name, keywords in payload["settings"].items():
        torch._dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
        keywords = dict(keywords)
        form, backend, config = keywords.pop("form"), keywords.pop("backend"), keywords.pop("config", None)
        graphs: list = []
        if backend == "recording aot_eager":
            backend = _recording_aot_eager(graphs)
        strategy = UlyssesDeepSpeedStrategy(sp_size=2, **keywords)
        if config:
            strategy.config["zero_optimization"].update(config)
        try:
            results[name] = fit(strategy, form, backend)
            results[name]["graphs_with_all_to_all"] = sum(graphs)
        except Exception as err:  # noqa: BLE001 - reported to the test
            results[name] = {"error": f"{type(err).__name__}: {err}"[:3000]}
    return results
