"""Scenarios run inside the worker processes started by ``tests/launcher.py`` (``python -m tests.worker NAME``).

Each scenario builds Trainers exactly as a user would (``Trainer(strategy=UlyssesDeepSpeedStrategy(...))``, the
world taken from the torchrun-style environment) and returns plain data for the test process to compare.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer, seed_everything

import lightning_ulysses  # noqa: F401  (registers the strategy names)
from lightning_ulysses import UlyssesDeepSpeedStrategy
from tests.models import SEED, CausalLM, OwnLossCausalLM, TokenDataset, tiny_llama_config


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

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.input_shapes.append(tuple(batch["input_ids"].shape))
        model = pl_module.model
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


def fit_one(run: dict) -> tuple[dict, Trainer]:
    """One SGD fit described by a dict (stage, kv_heads, batch_size, steps, seq_len, sp_size, ...); what each rank
    saw, and the Trainer for callers that record more."""
    seed_everything(SEED, verbose=False)
    config = tiny_llama_config(num_kv_heads=run["kv_heads"], num_heads=run.get("num_heads", 4),
                               attn=run.get("attn", "sdpa"))
    dataset = TokenDataset(run["num_rows"], run["seq_len"], ignore_after=run.get("ignore_after"))
    module_class = OwnLossCausalLM if run.get("own_loss") else CausalLM
    module = module_class(config, lr=run["lr"], dataset=dataset, batch_size=run["batch_size"])
    recorder = Recorder()
    strategy = UlyssesDeepSpeedStrategy(sp_size=run["sp_size"], stage=run["stage"], **run.get("strategy", {}))
    trainer = make_trainer(strategy, run["steps"], callbacks=[recorder], **run.get("trainer", {}))
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
                 "module_mesh_is_strategy_mesh": module.device_mesh is strategy.device_mesh},
        "train_batch_size": recorder.train_batch_size,
        "features_active": recorder.features_active,
    }, trainer


def parity(payload: dict) -> dict:
    """Several SGD fits (see :func:`fit_one`)."""
    return {"runs": [fit_one(run)[0] for run in payload["runs"]]}




class CountingCausalLM(CausalLM):
    """Counts the collectives of the first step: forward inside training_step, backward around engine.backward."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.forward_counts: dict[str, int] = {}
        self.backward_counts: dict[str, int] = {}
        self._backward_mode = None

    def training_step(self, batch, batch_idx):
        from torch.distributed.tensor.debug import CommDebugMode

        if batch_idx > 0:
            return super().training_step(batch, batch_idx)
        passes_before = RING_PASSES["n"]
        with CommDebugMode() as comm:
            loss = self.model(**batch).loss
        self.forward_counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
        if RING_PASSES["n"] > passes_before:  # CommDebugMode does not see point-to-point sends
            self.forward_counts["ring_passes"] = RING_PASSES["n"] - passes_before
        return loss

    def on_before_backward(self, loss):
        from torch.distributed.tensor.debug import CommDebugMode

        if not self.backward_counts and self._backward_mode is None:
            self._backward_mode = CommDebugMode()
            self._backward_mode.__enter__()
            self._passes_before_backward = RING_PASSES["n"]

    def on_after_backward(self):
        if self._backward_mode is not None:
            self._backward_mode.__exit__(None, None, None)
            self.backward_counts = {str(op).split(".")[-1]: n
                                    for op, n in self._backward_mode.get_comm_counts().items()}
            if RING_PASSES["n"] > self._passes_before_backward:
                self.backward_counts["ring_passes"] = RING_PASSES["n"] - self._passes_before_backward
            self._backward_mode = None


RING_PASSES = {"n": 0}  # point-to-point passes of K/V blocks around the ring (counted by a wrapper)


def _count_ring_passes() -> None:
    from lightning_ulysses import ring

    if getattr(ring._start_pass, "_counted", False):
        return
    original = ring._start_pass

    def counted(tensors, group):
        RING_PASSES["n"] += 1
        return original(tensors, group)

    counted._counted = True
    ring._start_pass = counted


def collectives(payload: dict) -> dict:
    """Collectives of one training step's forward and backward, per number of layers."""
    _count_ring_passes()
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


def lifecycle(payload: dict) -> dict:
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




def realdata(payload: dict) -> dict:
    """Fits (and evaluations) on datasets given in the payload; each case: dataset, batch_size, collate_fn,
    strategy kwargs, trainer kwargs, and which of validate/test/predict to run after fit."""
    from lightning_ulysses import SequenceParallelThroughputMonitor
    from tests.models import DataCausalLM

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


def combined(payload: dict) -> dict:
    """Several scenarios in one launch (imports cost seconds per process): ``{"name": [scenario, payload], ...}``."""
    import importlib

    out = {}
    for name, (scenario, sub_payload) in payload.items():
        module_name, _, function_name = scenario.rpartition(":") if ":" in scenario else ("tests.scenarios", ":", scenario)
        out[name] = getattr(importlib.import_module(module_name), function_name)(sub_payload)
    return out
