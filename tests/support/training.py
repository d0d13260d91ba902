"""What the scenarios share: Trainers built as a user builds them, a recorder of what each rank saw, one fit of the
parity harness. Scenarios (``tests/scenarios/``) run inside the worker processes that ``tests/support/launcher.py``
starts and return plain data for the test process to compare."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer, seed_everything

import lightning_ulysses  # noqa: F401  (registers the strategy names)
from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.models.form_check import probe_running
from tests.support.models import SEED, CausalLM, OwnLossCausalLM, TokenDataset, tiny_llama_config


# Read once: Lightning's environment teardown removes WORLD_SIZE from os.environ after each fit.
LAUNCH_WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))


class Recorder(Callback):
    """Per-step losses and input shapes as each rank saw them, and the trained weights (gathered under ZeRO-3)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.input_shapes: list[tuple[int, ...]] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.train_batch_size: int = 0
        self.features_active: dict = {}
        self.tile_shard_lens: list = []  # per step: the shard length tile counts followed (None: the local one)
        self.parameter_dtypes: set[str] = set()  # the dtypes the model's parameters train in (as the steps see them)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.input_shapes.append(tuple(batch["input_ids"].shape))
        model = pl_module.model
        self.parameter_dtypes.update(str(p.dtype) for p in model.parameters())
        self.features_active = {
            "tiled_mlps": sum("forward" in m.__dict__ for n, m in model.named_modules() if n.endswith(".mlp")),
            "forward_replaced": "forward" in model.__dict__,
            "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].float().item())
        self.tile_shard_lens.append(trainer.strategy.step_context.tile_shard_len)

    def on_train_end(self, trainer, pl_module) -> None:
        import deepspeed

        self.train_batch_size = trainer.strategy.deepspeed_engine.train_batch_size()

        params = dict(pl_module.model.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None,
                                               enabled=trainer.strategy.zero_stage_3):
            self.weights = {k: v.detach().clone() for k, v in params.items()}


class AttentionShapeSpy:
    """Records the query shape every call to torch's SDPA sees (the real function still runs)."""

    def __init__(self) -> None:
        self.shapes: set[tuple[int, ...]] = set()
        self._original = F.scaled_dot_product_attention

    def __enter__(self) -> "AttentionShapeSpy":
        def spy(query, *args, **kwargs):
            if not probe_running():  # the model-form check's probe is not one of the step's attention calls
                self.shapes.add(tuple(query.shape))
            return self._original(query, *args, **kwargs)

        F.scaled_dot_product_attention = spy
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = self._original


def run_cases(cases: list[dict], fit) -> dict:
    """``{case["name"]: fit(case)}`` for every case, one Trainer after the other in this process."""
    results = {}
    for case in cases:
        os.environ["WORLD_SIZE"] = str(LAUNCH_WORLD_SIZE)  # Lightning's teardown removes it after every fit
        results[case["name"]] = fit(case)
    return results


def make_trainer(strategy, max_steps: int, callbacks=(), **kwargs) -> Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=LAUNCH_WORLD_SIZE,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=list(callbacks),
    )
    defaults.update(kwargs)
    return Trainer(**defaults)


@dataclass(frozen=True)
class FitSpec:
    """One SGD fit of the tiny Llama (:func:`fit_one`).

    Attributes:
        stage: ZeRO stage. kv_heads / num_heads: the attention's heads. sp_size: ranks per SP group.
        batch_size: rows per micro-batch. steps: optimizer steps. seq_len / num_rows: the token dataset.
        lr: SGD learning rate. attn: attention implementation. ignore_after: positions past it carry no target.
        own_loss: the training step computes its loss with ``strategy.cross_entropy`` from logits.
        strategy / trainer: further keyword arguments of the strategy and the Trainer.
        optimizer: ``"sgd"`` (the parity default: Adam would hide a wrong gradient scale) or ``"adam"``.
    """

    stage: int
    kv_heads: int
    sp_size: int
    batch_size: int
    steps: int
    seq_len: int
    num_rows: int
    lr: float
    num_heads: int = 4
    attn: str = "sdpa"
    ignore_after: Optional[int] = None
    own_loss: bool = False
    strategy: dict = field(default_factory=dict)
    trainer: dict = field(default_factory=dict)
    optimizer: str = "sgd"  # or "adam" (torch.optim.Adam, default betas and eps)


def fit_one(run: FitSpec) -> tuple[dict, Trainer]:
    """One SGD fit; what each rank saw, and the Trainer for callers that record more."""
    seed_everything(SEED, verbose=False)
    config = tiny_llama_config(num_kv_heads=run.kv_heads, num_heads=run.num_heads, attn=run.attn)
    dataset = TokenDataset(run.num_rows, run.seq_len, ignore_after=run.ignore_after)
    module_class = OwnLossCausalLM if run.own_loss else CausalLM
    module = module_class(config, lr=run.lr, dataset=dataset, batch_size=run.batch_size)
    module.optimizer_name = run.optimizer
    recorder = Recorder()
    strategy = UlyssesDeepSpeedStrategy(sp_size=run.sp_size, stage=run.stage, **run.strategy)
    trainer = make_trainer(strategy, run.steps, callbacks=[recorder], **run.trainer)
    with AttentionShapeSpy() as spy:
        trainer.fit(module)
    return {
        "losses": recorder.losses,
        "logged_loss": trainer.callback_metrics["train_loss"].item(),
        "input_shapes": recorder.input_shapes,
        "attention_query_shapes": sorted(spy.shapes),
        "weights": ({k: v.float().cpu() for k, v in recorder.weights.items()}
                    if torch.distributed.get_rank() == 0 else None),
        "mesh": {"sp_rank": strategy.sp_rank, "dp_rank": strategy.dp_rank, "dp_size": strategy.dp_size,
                 "sp_group": strategy.layout.sp_group_ranks(),
                 "dim_names": strategy.device_mesh.mesh_dim_names,
                 "sp_mesh_group": torch.distributed.get_process_group_ranks(strategy.layout.sp_mesh.get_group()),
                 "module_mesh_is_strategy_mesh": module.device_mesh is strategy.device_mesh},
        "train_batch_size": recorder.train_batch_size,
        "parameter_dtypes": sorted(recorder.parameter_dtypes),
        "features_active": recorder.features_active,
    }, trainer
