"""Post-training objectives under SP=2 through a real Trainer (``tests/test_post_training.py``): each case is an
objective of ``tests/support/objectives.py`` written with the strategy's sequence-level API (or, for the refusals,
the one-device code users copy from TRL), at a ZeRO stage; it reports the losses, the trained weights (rank 0,
gathered under ZeRO-3), the error it ended with and whether any weight had changed by then."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, seed_everything
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.training import loss_graph
from tests.support.models import SEED
from tests.support.objectives import (LEARNING_RATES, OBJECTIVES, ONE_DEVICE_CODE, PRECISION_OBJECTIVES,
                                      SequenceParallel, build_models, collate_pairs, preference_rows, trainable,
                                      trained_weights)
from tests.support.training import make_trainer, run_cases

LR = 0.2


class PostTraining(LightningModule):
    def __init__(self, case: dict) -> None:
        super().__init__()
        for name, model in build_models(classifier=case["objective"].startswith("classifier")).items():
            setattr(self, name, model)
        self.case = case
        self.losses: list[float] = []
        self.walked: list[int] = []  # graph nodes the shard-local-loss check visits, per step
        self.frozen_layer_outputs: list[list[int]] = []  # the frozen reference's first decoder layer output shapes
        self.step_lengths: list[int] = []  # the full batch's padded length per step
        self.ref.model.layers[0].register_forward_hook(
            lambda m, args, out: self.frozen_layer_outputs.append(list((out[0] if isinstance(out, tuple) else
                                                                         out).shape)))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(preference_rows(), batch_size=2, collate_fn=collate_pairs)

    def training_step(self, batch, batch_idx):
        self.step_lengths.append(self.trainer.strategy.current_shard_info.padded_len)
        name = self.case["objective"]
        if name in ONE_DEVICE_CODE:
            loss = ONE_DEVICE_CODE[name](self, batch)
        else:
            loss = {**OBJECTIVES, **PRECISION_OBJECTIVES}[name](SequenceParallel(self.trainer.strategy), self, batch)
        self.walked.append(loss_graph.count_nodes_to_reductions(loss))
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(trainable(self), lr=LEARNING_RATES.get(self.case["objective"], LR))


def _weights(module, strategy) -> dict[str, torch.Tensor]:
    import deepspeed

    params = trained_weights(module)
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None, enabled=strategy.zero_stage_3):
        return {k: v.detach().float().clone() for k, v in params.items()}


def _fit(case: dict) -> dict:
    seed_everything(SEED, verbose=False)
    module = PostTraining(case)
    stage = case.get("stage", 2)
    initial = {k: v.detach().clone() for k, v in module.policy.named_parameters()}
    strategy = UlyssesDeepSpeedStrategy(sp_size=2, stage=stage, **case.get("strategy", {}))
    if stage == 3:  # every parameter partitioned (tiny models otherwise stay whole on every rank)
        strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    trainer = make_trainer(strategy, case.get("max_steps", 4), **case.get("trainer", {}))
    result: dict[str, Any] = {"error_type": None, "message": None}
    start = time.monotonic()
    try:
        trainer.fit(module)
    except Exception as err:  # noqa: BLE001 - the test asserts on type and message
        result.update(error_type=type(err).__name__, message=str(err))
    result["seconds"] = time.monotonic() - start
    weights = _weights(module, strategy)
    result.update(losses=module.losses, walked=module.walked, frozen_layer_outputs=module.frozen_layer_outputs,
                  step_lengths=module.step_lengths,
                  weights=weights if dist.get_rank() == 0 else None,
                  weights_unchanged=all(torch.equal(initial[k], weights[f"policy.{k}"]) for k in initial)
                  if result["error_type"] else None)
    return result


def run(payload: dict) -> dict:
    return run_cases(payload["cases"], _fit)


# ---------------------------------------------------------------------------------------------- Lightning Fabric
class FabricObjective(torch.nn.Module):
    """The models in one module (Fabric sets up one); its forward computes the objective, so that the models run
    inside the engine's forward pass, where the Fabric front end begins the step."""

    def __init__(self, objective: str) -> None:
        super().__init__()
        for name, model in build_models(classifier=objective.startswith("classifier")).items():
            setattr(self, name, model)
        self.objective = objective
        self.ops = None

    def forward(self, input_ids, batch):
        return OBJECTIVES[self.objective](self.ops, self, batch)


def fabric_fit(case: dict) -> dict:
    import os

    from lightning.fabric import seed_everything as fabric_seed

    from tests.scenarios.fabric import _fabric
    from tests.support.training import LAUNCH_WORLD_SIZE

    os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE)
    fabric_seed(SEED, verbose=False)
    fabric, strategy = _fabric({"sp": 2, "stage": case["stage"], "model": "hf"})
    if case["stage"] == 3:
        strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    module = FabricObjective(case["objective"])
    module.ops = SequenceParallel(strategy)
    optimizer = torch.optim.SGD(trainable(module), lr=LEARNING_RATES.get(case["objective"], LR))
    model, optimizer = fabric.setup(module, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(preference_rows(), batch_size=2, collate_fn=collate_pairs))
    losses = []
    for step, batch in enumerate(loader):
        if step == case.get("max_steps", 4):
            break
        loss = model(input_ids=batch["input_ids"], batch=batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    import deepspeed

    params = trained_weights(model.module)
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None, enabled=case["stage"] == 3):
        weights = {k: v.detach().float().clone() for k, v in params.items()}
    strategy.teardown()
    return {"losses": losses, "weights": weights if dist.get_rank() == 0 else None, "error_type": None}


def run_fabric(payload: dict) -> dict:
    return {case["name"]: fabric_fit(case) for case in payload["cases"]}


# ---------------------------------------------------------------------------------------------- row weights, directly
def _row_weight_cases(rank: int) -> dict[str, torch.Tensor]:
    """``[B, s]`` weights of this rank's shard (B = 4, s = 6, sp = 2) for ``check_row_weights``: the same rows cut
    in two; ``mask`` holds 2..6 targets of every row on each rank, a different count on each."""
    g = torch.Generator().manual_seed(7)  # the same on both ranks: the rows' advantages and masks
    adv = torch.randn(4, generator=g)
    masks = torch.zeros(2, 4, 6)
    for row, counts in enumerate([(6, 2), (3, 5), (4, 4), (2, 6)]):
        for part, count in enumerate(counts):
            masks[part, row, :count] = 1
    mask = masks[rank]
    row_count = masks.sum(dim=(0, 2))  # [B]: the whole row's count (what strategy.sequence_count gives)
    local = mask * (adv / mask.sum(1))[:, None]
    ulp = mask * (adv / row_count * (1 + 1e-7 * rank))[:, None]  # a rounding apart: 1e-7 relative
    lone = torch.zeros(4, 6)
    lone[:, 0] = 1.0 if rank == 0 else -1.0  # one weight per row and rank: no evidence of row-constant weights
    varying = mask * torch.rand(4, 6, generator=torch.Generator().manual_seed(rank))
    one_side = local.clone()
    one_side[0] = local[0] if rank == 0 else 0  # row 0: only rank 0 holds weights; rows 1-3 still differ
    return {
        "bool_mask": mask.bool(),
        "float_mask": mask,
        "mask_times_adv": mask * adv[:, None],
        "whole_row_count": mask * (adv / row_count)[:, None],
        "whole_row_count_float64": mask.double() * (adv.double() / row_count.double())[:, None],
        "rounding_apart": ulp,
        "per_token": varying,
        "lone_weights": lone,
        "empty_on_one_rank": torch.where(torch.tensor(rank == 1), torch.zeros_like(local), local),
        "local_count": local,
        "local_count_bf16": local.bfloat16(),
        "local_count_one_side_row": one_side,
        "local_count_equal_counts": local[2:3],  # row 2: 4 and 4 targets, so the same weight: undetectable
    }


def row_weights(payload: dict) -> dict:
    """``check_row_weights`` on each case of :func:`_row_weight_cases` over a real gloo group of 2: whether it
    raised (and its message), per case."""
    from lightning_ulysses.training.sequence_reductions import check_row_weights

    dist.init_process_group("gloo")
    try:
        out = {}
        for name, weights in _row_weight_cases(dist.get_rank()).items():
            try:
                check_row_weights(weights, dist.group.WORLD, torch.device("cpu"), "sequence_sum")
                out[name] = None
            except ValueError as err:
                out[name] = str(err)
        return out
    finally:
        dist.destroy_process_group()
