"""The architecture matrix, run by ``tests/test_architectures.py`` as
``launch(2, "architectures:run", {"names": [...]})``: every architecture of
``tests/architectures.py`` trained with SP=2 (ZeRO 2, SGD) for a few steps in the same two processes, or stopped
with an error. Rank 0 reports losses and final weights; every rank reports its error.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.models.form_check import probe_running
from lightning_ulysses.families.mixers import FAMILIES
from tests.support.architectures import ARCHITECTURES, batches, build_model
from tests.support.training import LAUNCH_WORLD_SIZE, make_trainer


class ArchitectureLM(LightningModule):
    def __init__(self, name: str, lr: float, steps: int, dtype: str = "float32") -> None:
        super().__init__()
        self.model = build_model(name, dtype=dtype)
        self.lr, self.steps = lr, steps
        self.losses: list[float] = []
        self.forward_kwargs = ARCHITECTURES[name].get("forward", {})

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch, **self.forward_kwargs).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        rows = [{k: v[0] for k, v in b.items()} for b in batches(self.steps)]
        return DataLoader(rows, batch_size=1)  # in order; every rank of the SP group reads the same rows


def _fit(name: str, steps: int, lr: float, stage: int = 2, dtype: str = "float32",
         strategy_options: Optional[dict] = None) -> dict[str, Any]:
    """``stage`` 3: every parameter partitioned (``stage3_param_persistence_threshold=0``)."""
    result: dict[str, Any] = {"error": None}
    try:
        if dtype == "float64":  # Lightning's DeepSpeed precision ("32-true") would cast the model to fp32
            from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision

            DeepSpeedPrecision.convert_module = lambda self, model: model
        module = ArchitectureLM(name, lr, steps, dtype)
        result["mixer_families"] = _mixer_families(module.model)
        strategy = UlyssesDeepSpeedStrategy(sp_size=2, stage=stage, **(strategy_options or {}))
        if stage == 3:
            strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        trainer = make_trainer(strategy, steps, use_distributed_sampler=False)
        trainer.fit(module)
    except Exception as err:  # noqa: BLE001 - the test asserts on the message
        result["error"] = f"{type(err).__name__}: {err}"
        return result
    result["losses"] = module.losses
    import deepspeed

    params = dict(module.model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        final = {k: v.detach().to(torch.float64 if dtype == "float64" else torch.float32).clone()
                 for k, v in params.items()}
    if torch.distributed.get_rank() == 0:
        result["final"] = final
    return result


def _mixer_families(model: torch.nn.Module) -> list[list]:
    """``[mixer class, family recipe or None (runs whole), {conv channels / head counts of this rank}]`` for every
    sequence mixer."""
    from lightning_ulysses.models.mixer_heads import head_slicing
    from lightning_ulysses.models.refusals import sequence_mixers

    rank = int(os.environ["RANK"])  # before fit: the process group is not up yet
    found = []
    for mixer in sequence_mixers(model):
        recipe = next((r.__name__ for r in FAMILIES if r(mixer, rank, 2) is not None), None)
        slicing = head_slicing(mixer, rank, 2)
        split = None if slicing is None else {**{k: len(v) for k, v in slicing.channels.items()},
                                              **{k: v for k, v in slicing.attributes.items() if "head" in k}}
        found.append([type(mixer).__name__, recipe, split])
    return found


def run(payload: dict) -> dict:
    if payload.get("mutate") == "no_position_numbering":  # the strategy forgets RoBERTa-style numbering
        from lightning_ulysses.models import position_numbering

        position_numbering.own_numbering_padding_index = lambda model: None
    results = {}
    for name in payload["names"]:
        os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE)  # Lightning's teardown removes it after every fit
        results[name] = _fit(name, payload["steps"], ARCHITECTURES[name].get("lr", payload["lr"]),
                             payload.get("stage", 2), payload.get("dtype", "float32"),
                             {**ARCHITECTURES[name].get("strategy", {}), **(payload.get("strategy") or {})})
    return results


def mixer_collectives(payload: dict) -> dict:
    """Collectives of one training step of ``payload["arch"]`` with ``m`` mixer layers and one attention layer, for
    every ``m`` in ``payload["mixer_layers"]`` (forward inside the step, backward around DeepSpeed's backward)."""
    from lightning.pytorch import seed_everything
    from transformers import AutoModelForCausalLM

    from tests.support.architectures import build_config
    from tests.support.models import SEED, TokenDataset
    from tests.support.models import CountingCausalLM, tiny_llama_config

    import sys

    modeling = sys.modules[type(build_model(payload["arch"])).__module__]
    # (function, index of its [B, S, heads, d] argument), or None: no module-level recurrence to watch
    name, position = payload.get("recurrence", ("torch_chunk_gated_delta_rule", 2)) or (None, None)
    recurrence = getattr(modeling, name) if name else None
    shapes: list = []

    def spy(*args, **kwargs):  # the shapes the mixer's own recurrence runs on (not the model-form check's probe)
        if not probe_running():
            shapes.append(tuple(args[position].shape))
        return recurrence(*args, **kwargs)

    if name:
        setattr(modeling, name, spy)
    out = {}
    for m in payload["mixer_layers"]:
        os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE)
        seed_everything(SEED, verbose=False)
        shapes.clear()
        config = build_config(payload["arch"])
        config.num_hidden_layers = m + 1
        if payload.get("mixer_kind"):
            config.layer_types = [payload["mixer_kind"]] * m + ["full_attention"]
        else:  # the attention layer last, by index (bamba)
            config.attn_layer_indices = [m]
        module = CountingCausalLM(tiny_llama_config(num_kv_heads=2), dataset=TokenDataset(2, 32))
        torch.manual_seed(0)
        attn = ARCHITECTURES[payload["arch"]].get("attn", "sdpa")  # pure state-space models have no attention
        module.model = AutoModelForCausalLM.from_config(config, **({"attn_implementation": attn} if attn else {}))
        trainer = make_trainer(UlyssesDeepSpeedStrategy(sp_size=2, stage=payload.get("stage", 2)), max_steps=1)
        trainer.fit(module)
        out[m] = {"forward": module.forward_counts, "backward": module.backward_counts,
                  "recurrence_value_shapes": sorted(set(shapes))}
    if name:
        setattr(modeling, name, recurrence)
    return out
